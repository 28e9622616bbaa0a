"""The real entry point under torchrun: 2 ranks, sync GRPO, metrics, TensorBoard, checkpoint, resume, HF export."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, TINY_HF, run_torchrun

REQUIRED = {"step", "reward_mean", "tokens_per_s", "step_time_s", "policy_version", "loss", "mode"}


def _rows(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_sync_mode_trains_checkpoints_resumes_and_exports(tmp_path):
    dump = str(tmp_path / "run")
    common = [
        "-m", "reflow.train", "--config", "train_configs/tiny.toml",
        f"--job.dump_folder={dump}",
        "--training.prompts_per_step=4", "--training.group_size=4",
        "--checkpoint.enable=true", "--checkpoint.interval=2",
        "--metrics.eval_interval=2", "--metrics.eval_num_prompts=8",
        "--kl.coef=0.05",  # the frozen reference policy (KL penalty), through the resume too
    ]
    run_torchrun(2, common + ["--training.steps=2"])
    # the starting policy's evaluation first, in a row of its own; then the steps, step 2's with an evaluation
    evaluation, *rows = _rows(dump)
    assert evaluation["step"] == 0 and evaluation["eval_policy_version"] == 0 and 0 <= evaluation["eval_reward"] <= 1
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["num_samples"] == 16 and r["mode"] == "sync"
        assert r["tokens_per_s"] > 0 and 0 <= r["reward_mean"] <= 1
        # on-policy: vLLM sampled with exactly the trainer's weights
        assert r["behavior_logprob_gap_max"] < 1e-3
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert rows[1]["kl_ref"] > 0.0
    assert "eval_reward" not in rows[0] and rows[1]["eval_policy_version"] == 2
    assert os.path.exists(os.path.join(dump, "checkpoint", "step-2", ".metadata"))
    assert glob.glob(os.path.join(dump, "tb", "events.out.tfevents*"))

    record = json.load(open(os.path.join(dump, "run.json")))  # what produced the run, kept with it
    assert record["config"]["kl"]["coef"] == 0.05 and record["resumes"] == [] and "torch" in record["versions"]
    # resume: picks up step 2's checkpoint and continues to step 3 (the run's config, with more steps)
    proc = run_torchrun(2, common + ["--training.steps=3"])
    assert "resumed from step 2" in proc.stderr
    assert [r["from_step"] for r in json.load(open(os.path.join(dump, "run.json")))["resumes"]] == [2]
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # a resumed run does not score its starting policy again
    assert rows[-1]["policy_version"] == 3

    # an intermediate checkpoint (step 2) exported to HF format: whole, and in shards with an index; both load
    # in transformers and hold the same tensors, changed by training
    for out, shard in ((os.path.join(dump, "hf_step2"), "5"), (os.path.join(dump, "hf_step2_sharded"), "0.0002")):
        proc = subprocess.run(
            [sys.executable, "-m", "reflow.export", "--config", "train_configs/tiny.toml", "--step", "2", "--out", out,
             "--shard-gib", shard, *common[4:]],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0 and "step 2 ->" in proc.stdout, proc.stderr[-2000:]
    whole = load_file(os.path.join(dump, "hf_step2", "model.safetensors"))
    index = json.load(open(os.path.join(dump, "hf_step2_sharded", "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(whole)
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(os.path.join(dump, "hf_step2_sharded", file))[name], whole[name]), name
    base = load_file(os.path.join(TINY_HF, "model.safetensors"))
    assert set(whole) == set(base) and any(not torch.equal(whole[k], base[k]) for k in base)
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForCausalLM.from_pretrained(os.path.join(dump, "hf_step2_sharded"), dtype=torch.float32)
    missing = subprocess.run(
        [sys.executable, "-m", "reflow.export", "--config", "train_configs/tiny.toml", "--step", "7", *common[4:]],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "available: [2, 3]" in missing.stderr

    # the exported policy is a loadable HF folder with trained (changed) weights
    out = os.path.join(dump, "hf_final")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert os.path.exists(os.path.join(out, name)), name
    new, old = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(TINY_HF, "model.safetensors"))
    assert set(new) == set(old)
    assert any(not torch.equal(new[k], old[k]) for k in old)


def test_bad_config_fails_before_starting(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "reflow.train", "--config", "train_configs/tiny.toml", "--training.group_size=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "training.group_size" in proc.stderr


def test_sync_dynamic_sampling_trains_exactly_the_batch_of_groups_with_signal(tmp_path):
    """Sync mode with DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts
    generated until the step has exactly prompts_per_step groups with signal, on 2 ranks.

    The ranks keep different numbers of groups, so in micro-batches of 2 rows and two minibatches they run
    different numbers of real passes: before issue 37's fix they agreed on the padding passes after their
    own and the run hung in crossed collectives from step 2 (the timeout below ends such a hang)."""
    dump = str(tmp_path / "run")
    run_torchrun(2, [
        "-m", "reflow.train", "--config", "train_configs/tiny.toml", f"--job.dump_folder={dump}",
        "--training.prompts_per_step=8", "--training.group_size=4", "--training.steps=3",
        "--training.micro_batch_size=2", "--training.num_minibatches=2",
        "--reward.dynamic_sampling=true", "--checkpoint.export_hf=false", "--metrics.enable_tensorboard=false",
    ], timeout=300)
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # a uniform group is drawn with probability ~0.3 at this policy's rewards: over 24+ groups some are
    assert sum(r["dynamic_sampling_filtered_frac"] for r in rows) > 0
    for r in rows:
        assert r["num_samples"] == 32  # exactly 8 groups of 4, each with signal
        assert 0 <= r["dynamic_sampling_rounds"] <= 8
        assert 0 < r["reward_std"]
        # over every generated sample, the dropped groups included; with none dropped, the trained ones
        if r["dynamic_sampling_filtered_frac"] == 0:
            assert r["received_reward_mean"] == pytest.approx(r["reward_mean"], abs=1e-12)
        assert 0.0 <= r["received_reward_mean"] <= 1.0
