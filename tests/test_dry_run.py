"""--dry-run validates every shipped config (including the GPU recipes) without starting ranks."""

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "train_configs", "*.toml"))))
def test_dry_run(path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "reflow.train", "--config", path, "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the resolved config, then the summary
    summary = json.loads(proc.stdout[proc.stdout.rindex("{\n  \"placement\""):])
    assert summary["num_params"] > 0
    assert "trainer HSDP" in summary["placement"]
    assert summary["feasible_placements"] and all(name.startswith("T") for name in summary["feasible_placements"])
    # every shipped config's memory plan fits its recipe's device (tests/test_memory_plan.py checks the terms)
    plan = summary["memory_plan"]
    assert plan["fits"] and not plan["problems"] and "memory plan per rank" in proc.stdout
    assert set(plan["roles"]) in ({"colocated"}, {"trainer", "rollout"})


def test_dry_run_reports_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nrecipe = \"qwen3_999b\"\n")
    proc = subprocess.run(
        [sys.executable, "-m", "reflow.train", "--config", str(bad), "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "model.recipe" in proc.stderr and "qwen3_999b" in proc.stderr

# the published algorithm recipes: (config, paper named in it, the choices that make it that recipe)
RECIPES = {
    "grpo": ("2402.03300", {"advantage.estimator": "grpo", "loss.aggregation": "seq_mean_token_mean", "kl.coef": 0.04,
                            "kl.estimator": "k3", "loss.clip_high": 0.2}),
    "dr_grpo": ("2503.20783", {"advantage.estimator": "dr_grpo", "loss.aggregation": "token_sum_norm", "kl.coef": 0.0,
                               "loss.norm_tokens": 8192}),
    "dapo": ("2503.14476", {"loss.clip_low": 0.2, "loss.clip_high": 0.28, "loss.aggregation": "token_mean",
                            "reward.dynamic_sampling": True, "reward.overlong_buffer": 2048, "kl.coef": 0.0}),
    "gspo": ("2507.18071", {"loss.policy": "gspo", "loss.gspo_clip_low": 3e-4, "loss.gspo_clip_high": 4e-4,
                            "loss.aggregation": "seq_mean_token_mean"}),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_published_recipe_configs_say_what_their_paper_does(name):
    from reflow.config import ConfigManager

    path = os.path.join(ROOT, "train_configs", f"{name}_qwen3_8b_math.toml")
    paper, choices = RECIPES[name]
    assert paper in open(path).read()  # the paper is named (arXiv id)
    cfg = ConfigManager().parse_args(["--config", path])
    for dotted, value in choices.items():
        section, key = dotted.split(".")
        assert getattr(getattr(cfg, section), key) == value, dotted
    assert cfg.loss.norm_tokens in (0, cfg.rollout.max_new_tokens)  # Dr. GRPO's constant is the generation budget
