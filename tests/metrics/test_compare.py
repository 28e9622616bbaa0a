"""Runs side by side: seeds of one configuration become a mean and a band, wall time accumulates the steps' time,
the replayed share and evictions come from the step rows, placement changes are found; the figure is a PNG of
eight labelled panels drawn by matplotlib."""

import json
import os

import pytest

from reflow.metrics.compare import main, panel_series, parse_groups, transitions


def _run(folder, rewards, replayed=None, transition_after=None):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, reward in enumerate(rewards, start=1):
            row = {"step": step, "loss": 0.1, "reward_mean": reward, "step_time_s": 2.0, "tokens_per_s": 100.0 * step,
                   "evicted_aged": 1, "evicted_at_sync": 2}
            if replayed is not None:
                row.update(fresh_samples=12, replayed_samples=replayed[step - 1])
            f.write(json.dumps(row) + "\n")
            if step == transition_after:
                f.write(json.dumps({"step": step, "transition": "T1x1+R3 -> T2x1+R2", "transition_s": 1.5}) + "\n")
        f.write(json.dumps({"step": len(rewards), "eval_reward": rewards[-1], "eval_policy_version": len(rewards)}) + "\n")
    return str(folder)


def test_seeds_combine_into_a_mean_and_a_band(tmp_path):
    a = _run(tmp_path / "s0", [0.0, 0.2, 0.4], replayed=[0, 4, 4], transition_after=2)
    b = _run(tmp_path / "s1", [0.2, 0.4, 0.6], replayed=[0, 4, 4])
    groups = parse_groups([f"reflow={a},{b}"])
    raw = panel_series(groups, "reward_mean", "step", 1)["reflow"]
    assert raw.x == [1, 2, 3] and raw.mean == pytest.approx([0.1, 0.3, 0.5]) and raw.std == pytest.approx([0.1] * 3)
    smooth = panel_series(groups, "reward_mean", "step", 5)["reflow"]
    assert smooth.mean == pytest.approx([0.1, 0.2, 0.3])  # moving averages of what each step has seen
    wall = panel_series(groups, "reward_mean", "wall_s", 1)["reflow"]
    assert wall.x == [2.0, 4.0, 6.0]  # 2 s a step
    share = panel_series(groups, "replay_fraction", "step", 1)["reflow"]
    assert share.mean == pytest.approx([0.0, 0.25, 0.25])
    assert panel_series(groups, "evicted", "step", 1)["reflow"].mean == [3.0, 3.0, 3.0]
    assert panel_series(groups, "eval_reward", "step", 1)["reflow"].mean == pytest.approx([0.5])
    assert transitions(groups) == {"reflow": [2]}
    assert "reflow" not in panel_series(groups, "trainer_idle_ratio", "step", 1)  # never logged: left out


def test_the_command_draws_a_png_and_names_a_folder_without_metrics(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = _run(tmp_path / "async", [0.1, 0.2])
    b = _run(tmp_path / "reflow", [0.1, 0.3], replayed=[0, 2])
    out = str(tmp_path / "compare.png")
    assert main([a, b, "--out", out]) == 0
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(out) > 20_000
    assert main([str(tmp_path / "missing"), "--out", out]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
