"""Each tiny variant of a paper recipe trains under torchrun (2 ranks, reflow mode, sigma = tau = 0.5, delta = 1)
with its real reward and environment, and learns: the mean training reward of the last steps is clearly above
that of the first ones. The environments are the real ones: math-verify for the boxed answers, the
calculator tool, and the sandboxed test runner of the coding agent."""

import json
import os

import pytest

from tests.conftest import run_torchrun

# config, steps, steps averaged at each end, the least rise of the mean training reward
VARIANTS = {
    "math": ("train_configs/tiny_math.toml", 30, 5, 0.10),
    "retool": ("train_configs/tiny_retool.toml", 30, 5, 0.10),
    "coding": ("train_configs/tiny_coding.toml", 30, 5, 0.10),
}


def _rows(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "reward_mean" in row]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_variant_learns(tmp_path, variant):
    config, steps, ends, rise = VARIANTS[variant]
    dump = str(tmp_path / variant)
    run_torchrun(2, ["-m", "reflow.train", "--config", config, f"--job.dump_folder={dump}", f"--training.steps={steps}",
                     "--metrics.eval_interval=0"])
    rows = _rows(dump)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    first = sum(r["reward_mean"] for r in rows[:ends]) / ends
    last = sum(r["reward_mean"] for r in rows[-ends:]) / ends
    print(f"{variant}: training reward {first:.3f} over steps 1-{ends} -> {last:.3f} over the last {ends}")
    assert last >= first + rise, (first, last)
    assert all(r["staleness_max"] <= 1 for r in rows)  # delta = 1
    if variant in ("retool", "coding"):
        # the environment answered, and its tokens were in the responses without being trained on
        assert sum(r["tool_calls_mean"] for r in rows) > 0 and max(r["env_token_frac"] for r in rows) > 0
    else:
        assert all(r["tool_calls_mean"] == 0 and r["env_token_frac"] == 0 for r in rows)
