"""One metrics path: rank 0 writes metrics.jsonl, TensorBoard events and a console progress bar.

Other ranks hold a logger that does nothing, so callers never branch on rank.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any


class MetricsLogger:
    def __init__(self, dump_folder: str, enabled: bool, total_steps: int, tensorboard: bool = True, progress: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = progress and enabled
        self.start = time.time()
        self._tb = None
        self._file = None
        if not enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(dump_folder, "tb"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        self._file.write(json.dumps(row, default=_jsonable) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self.progress:
            self._draw(step, row)

    def _draw(self, step: int, row: dict[str, Any]) -> None:
        width = 24
        done = min(step / max(self.total_steps, 1), 1.0)
        bar = "#" * int(width * done) + "-" * (width - int(width * done))
        elapsed = time.time() - self.start
        eta = elapsed / max(done, 1e-9) * (1 - done)
        line = (
            f"\r[{bar}] step {step}/{self.total_steps} reward {row.get('reward_mean', float('nan')):.3f} "
            f"loss {row.get('loss', float('nan')):+.4f} tok/s {row.get('tokens_per_s', 0):.0f} "
            f"{elapsed:.0f}s<{eta:.0f}s"
        )
        sys.stderr.write(line + ("\n" if step >= self.total_steps else ""))
        sys.stderr.flush()

    def info(self, message: str) -> None:
        if self.enabled:
            sys.stderr.write(("\n" if self.progress else "") + f"[reflow] {message}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(v: Any):
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)
