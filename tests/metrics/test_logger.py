"""Console progress: a redrawn bar on a terminal, plain lines every N steps elsewhere (a Slurm log)."""

import json

from reflow.metrics.logger import MetricsLogger


def _log_steps(tmp_path, capsys, tty: bool) -> str:
    logger = MetricsLogger(str(tmp_path), True, total_steps=25, tensorboard=False, progress=True, plain_every=10, tty=tty)
    for step in range(1, 26):
        logger.log(step, {"loss": 0.5, "reward_mean": 0.25, "tokens_per_s": 100.0})
        if step == 12:
            logger.log(step, {"planner_reason": "hold"})  # a decision row: no progress line of its own
    logger.close()
    assert len([json.loads(line) for line in open(tmp_path / "metrics.jsonl")]) == 26
    return capsys.readouterr().err


def test_off_a_terminal_progress_is_plain_lines_every_n_steps(tmp_path, capsys):
    err = _log_steps(tmp_path, capsys, tty=False)
    assert "\r" not in err
    assert [line.split()[2] for line in err.splitlines()] == ["1/25", "10/25", "20/25", "25/25"]


def test_on_a_terminal_the_bar_is_redrawn(tmp_path, capsys):
    err = _log_steps(tmp_path, capsys, tty=True)
    assert err.count("\r") == 25 and err.endswith("\n") and err.count("\n") == 1


def test_the_time_left_comes_from_the_steps_pace_not_the_start_up(tmp_path, capsys, monkeypatch):
    """The first step's time includes start-up (tens of seconds of engine build): the time left is estimated
    from the steps after it, and the first line shows none."""
    import reflow.metrics.logger as logger_module

    clock = [1000.0]
    monkeypatch.setattr(logger_module.time, "time", lambda: clock[0])
    logger = MetricsLogger(str(tmp_path), True, total_steps=10, tensorboard=False, progress=True, plain_every=1, tty=False)
    clock[0] += 30.0  # start-up and the first step
    logger.log(1, {"loss": 0.1, "reward_mean": 0.2, "tokens_per_s": 1.0})
    clock[0] += 2.0
    logger.log(2, {"loss": 0.1, "reward_mean": 0.2, "tokens_per_s": 1.0})
    clock[0] += 2.0
    logger.log(3, {"loss": 0.1, "reward_mean": 0.2, "tokens_per_s": 1.0, "fresh_samples": 24, "replayed_samples": 8,
                   "staleness_max": 2, "trainer_idle_ratio": 0.31, "rollout_idle_ratio": 0.05, "evicted_aged": 4,
                   "evicted_at_sync": 1, "evicted_no_signal": 8})
    logger.close()
    first, second, third = capsys.readouterr().err.splitlines()
    assert first.endswith("30s<?")
    assert second.endswith("32s<16s")  # 2 s a step, 8 steps left
    assert third.endswith("34s<14s | fresh 24 replay 8 stale<=2 idle T 0.31 R 0.05 evicted 5 filtered 8")
