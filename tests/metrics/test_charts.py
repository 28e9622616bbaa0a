"""The benchmark's and the simulator's charts draw with matplotlib from their own result layouts."""

import os

import pytest

pytest.importorskip("matplotlib")


def _png(path) -> bool:
    return open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 20_000


def test_the_modes_benchmark_chart(tmp_path):
    from reflow.bench.modes import write_png

    modes = {m: {"eval_reward_at_equal_time": 0.3, "eval_reward_at_equal_time_spread": {"std": 0.01},
                 "trainer_idle_ratio": 0.2, "rollout_idle_ratio": 0.3} for m in ("sync", "async", "reflow")}
    rows = {m: [{"step_time_s": 1.0, "reward_mean": 0.1 * k} for k in range(10)] for m in modes}
    write_png(str(tmp_path / "modes.png"), {"modes": modes, "start_eval_reward": 0.2, "equal_time_s": 10.0}, rows)
    assert _png(tmp_path / "modes.png")


def test_the_simulator_charts(tmp_path):
    from reflow.sim.__main__ import _compare_png, _validate_png

    pair = {"tokens_per_s": 3000.0, "rollout_idle_ratio": 0.2}
    _validate_png(str(tmp_path / "validate.png"), {"async": {"measured": pair, "simulated": pair}})
    row = {"trainer_idle_ratio": 0.1, "rollout_idle_ratio": 0.2, "timeline": [{"placement": "T2x1+R6"}, {"placement": "T3x1+R5"}]}
    modes = ("sync", "one_step_off", "async", "reflow_static_best", "reflow_adaptive")
    _compare_png(str(tmp_path / "compare.png"), {8: dict.fromkeys(modes, row)})
    assert _png(tmp_path / "validate.png") and _png(tmp_path / "compare.png")
