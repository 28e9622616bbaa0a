"""One metrics path: rank 0 writes metrics.jsonl, its sinks (TensorBoard, Weights & Biases: ``reflow.metrics.
sinks``, lists as histograms) and console progress.

Progress is a redrawn bar on a terminal; off a terminal (a Slurm log, a pipe) it is one plain line every
``plain_every`` logged steps and at the last, since a carriage-return bar would become one giant line there.
Other ranks hold a logger that does nothing, so callers never branch on rank.

The time left is estimated from the steps' own pace (the first logged step's time includes start-up: the
engine build, the first compile, a resume's load), so the first line shows none. A decoupled mode's line
also says what the replay cycle did: fresh and replayed samples, the stalest sample trained, trainer and
rollout idle, and the samples evicted unused (and filtered, with dynamic sampling).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from reflow.metrics.sinks import TensorBoardSink, WandbSettings, WandbSink, split_row


class MetricsLogger:
    def __init__(
        self, dump_folder: str, enabled: bool, total_steps: int, tensorboard: bool = True, progress: bool = True,
        plain_every: int = 10, tty: bool | None = None, wandb: "WandbSettings | None" = None, config: dict | None = None,
    ):
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = progress and enabled
        self.tty = sys.stderr.isatty() if tty is None else tty
        """Draw the bar (a terminal), or print plain lines (``plain_every``)."""
        self.plain_every = max(1, plain_every)
        self._logged = 0
        self.start = time.time()
        self._pace: tuple[int, float] | None = None
        """(step, time) of the first logged step: the time left is estimated from the steps after it."""
        self.sinks: list = []
        self._file = None
        if not enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            self.sinks.append(TensorBoardSink(dump_folder))
        if wandb is not None:
            self.sinks.append(WandbSink(wandb, dump_folder, config or {}))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        self._file.write(json.dumps(row, default=_jsonable) + "\n")
        self._file.flush()
        if self.sinks:
            scalars, series = split_row(metrics)
            for sink in self.sinks:
                sink.write(step, scalars, series)
        if self.progress:
            self._draw(step, row)

    def _draw(self, step: int, row: dict[str, Any]) -> None:
        if "loss" not in row:  # a placement decision's or a transition's row: no progress in it
            return
        self._logged += 1
        done = min(step / max(self.total_steps, 1), 1.0)
        now = time.time()
        elapsed = now - self.start
        if self._pace is None or step <= self._pace[0]:
            self._pace = (step, now)
            left = "?"
        else:
            first_step, first_time = self._pace
            left = f"{(now - first_time) / (step - first_step) * max(self.total_steps - step, 0):.0f}s"
        summary = (
            f"step {step}/{self.total_steps} reward {row.get('reward_mean', float('nan')):.3f} "
            f"loss {row.get('loss', float('nan')):+.4f} tok/s {row.get('tokens_per_s', 0):.0f} {elapsed:.0f}s<{left}"
            + _replay_cycle(row)
        )
        if self.tty:
            width = 24
            bar = "#" * int(width * done) + "-" * (width - int(width * done))
            sys.stderr.write(f"\r[{bar}] {summary}" + ("\n" if step >= self.total_steps else ""))
        elif self._logged % self.plain_every == 0 or step >= self.total_steps or self._logged == 1:
            sys.stderr.write(f"[reflow] {summary}\n")
        sys.stderr.flush()

    def info(self, message: str) -> None:
        if self.enabled:
            sys.stderr.write(("\n" if self.progress and self.tty else "") + f"[reflow] {message}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def _replay_cycle(row: dict[str, Any]) -> str:
    """A decoupled step's replay cycle in a few words ("" for a sync step)."""
    if "replayed_samples" not in row:
        return ""
    evicted = sum(int(row.get(f"evicted_{cause}", 0)) for cause in ("arrived_stale", "aged", "at_sync"))
    text = (
        f" | fresh {row.get('fresh_samples', 0)} replay {row['replayed_samples']} stale<={row.get('staleness_max', 0)}"
        f" idle T {row.get('trainer_idle_ratio', 0.0):.2f} R {row.get('rollout_idle_ratio', 0.0):.2f} evicted {evicted}"
    )
    if row.get("evicted_no_signal"):
        text += f" filtered {int(row['evicted_no_signal'])}"
    return text


def _jsonable(v: Any):
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)
