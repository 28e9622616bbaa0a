"""A rank killed with SIGKILL: the other ranks fail fast (the dead peer's connections close; no collective waits
past job.collective_timeout_s), torchrun --max-restarts starts every rank again, and they resume from the latest
checkpoint and finish the run."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, free_port


def test_a_killed_rank_is_restarted_and_the_run_resumes_from_its_checkpoint(tmp_path):
    dump = tmp_path / "run"
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
    )
    agent = subprocess.Popen(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
            "--max-restarts", "1", "--monitor-interval", "0.5",
            "-m", "reflow.train", "--config", "train_configs/tiny.toml", f"--job.dump_folder={dump}",
            "--training.steps=8", "--training.prompts_per_step=6", "--training.group_size=4", "--rollout.max_new_tokens=16",
            "--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.export_hf=false",
            "--job.collective_timeout_s=60", "--metrics.enable_progress_bar=false",
        ],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    checkpoint = dump / "checkpoint" / "step-2" / ".metadata"
    deadline = time.time() + 400
    while not checkpoint.exists():
        assert agent.poll() is None and time.time() < deadline, agent.communicate()[1][-3000:]
        time.sleep(0.5)
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()]
    assert len(workers) == 3
    killed_at = time.time()
    os.kill(workers[1], signal.SIGKILL)
    out, err = agent.communicate(timeout=600)
    assert agent.returncode == 0, err[-4000:]
    log = out + err
    assert "resumed from step" in log
    resumed_from = int(log.split("resumed from step ")[1].split()[0])
    assert resumed_from >= 2
    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps[-1] == 8 and set(steps) == set(range(1, 9))  # the steps after the checkpoint ran again
    assert time.time() - killed_at < 300  # nobody waited for the dead rank until a long timeout
