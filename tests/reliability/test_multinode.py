"""Multi-node launch through torchrun's own rendezvous, as the Slurm script does it: two torchrun agents on this
machine (two "nodes", ``--nnodes 2``, c10d rendezvous on 127.0.0.1), one rank each. A reflow run trains on one,
generates on the other, syncs weights across them every step, and exports."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, free_port


def test_two_torchrun_agents_train_sync_and_export(tmp_path):
    dump = tmp_path / "run"
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
    )
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "reflow-multinode",
                "-m", "reflow.train", "--config", "train_configs/tiny.toml", f"--job.dump_folder={dump}",
                "--training.mode=reflow", "--placement.num_rollout_ranks=1", "--training.steps=3",
                "--training.prompts_per_step=4", "--training.group_size=4", "--rollout.max_new_tokens=16",
                "--weight_sync.interval=1", "--replay.delta=1", "--metrics.enable_progress_bar=false",
            ],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-4000:]
    log = "".join(out + err for out, err in outputs)
    assert "world 2" in log and "1 rollout ranks" in log
    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["weight_sync_s"] > 0 for r in steps)  # the trainer "node" synced the generating one every step
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    assert (dump / "hf_final" / "model.safetensors").exists()
