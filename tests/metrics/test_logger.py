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
