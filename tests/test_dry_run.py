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
