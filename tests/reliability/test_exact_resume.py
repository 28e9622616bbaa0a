"""Exact resume: a run stopped and resumed from its checkpoint trains on the same samples and ends with the same
parameters, bitwise on CPU, as the run that never stopped (sampling is a function of each request's seed and
prefix, not of the engine's history: ``reflow.rollout.engine``)."""

import json
import os

import torch
from safetensors.torch import load_file

from tests.conftest import run_torchrun


def _train(dump: str, steps: int, *extra: str) -> None:
    run_torchrun(2, [
        "-m", "reflow.train", "--config", "train_configs/tiny.toml", f"--job.dump_folder={dump}",
        "--training.prompts_per_step=4", "--training.group_size=4", "--rollout.max_new_tokens=24",
        "--metrics.enable_progress_bar=false", f"--training.steps={steps}", *extra,
    ])


def _rows(dump: str) -> dict[int, dict]:
    return {r["step"]: r for r in (json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r}


def test_sync_six_steps_straight_equal_three_resume_three(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    _train(straight, 6)
    _train(resumed, 3, "--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.export_hf=false")
    _train(resumed, 6, "--checkpoint.enable=true", "--checkpoint.interval=3")
    a, b = _rows(straight), _rows(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):  # the same sample stream: rewards and lengths step by step
        assert (a[step]["reward_mean"], a[step]["response_len_mean"]) == (b[step]["reward_mean"], b[step]["response_len_mean"]), step
    final_a = load_file(os.path.join(straight, "hf_final", "model.safetensors"))
    final_b = load_file(os.path.join(resumed, "hf_final", "model.safetensors"))
    assert final_a.keys() == final_b.keys()
    different = [name for name in final_a if not torch.equal(final_a[name], final_b[name])]
    assert not different, different[:5]
