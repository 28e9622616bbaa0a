"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor.

``lr_factor(update)`` multiplies ``training.lr`` at optimizer update ``update`` (0-based, counted over the
run's ``steps x ppo_epochs x num_minibatches`` updates, and checkpointed with the trainer, so a resumed run
continues the schedule where it stopped):

    warmup   (u + 1) / W                                   for u < W
    then     p = (u - W) / max(U - W, 1), clamped to [0, 1]
             constant  1
             linear    1 - (1 - f) p
             cosine    f + (1 - f) (1 + cos(pi p)) / 2     (Loshchilov and Hutter 2017, without restarts)

with W warmup updates, U total updates and f = ``training.min_lr_ratio``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reflow.algorithms.names import DECAYS, check_choice


@dataclass(frozen=True)
class LRSchedule:
    warmup_updates: int = 0
    total_updates: int = 1
    decay: str = "constant"
    min_ratio: float = 0.0

    def __post_init__(self):
        check_choice("learning-rate decay", self.decay, DECAYS)

    def lr_factor(self, update: int) -> float:
        if update < self.warmup_updates:
            return (update + 1) / self.warmup_updates
        if self.decay == "constant":
            return 1.0
        span = max(self.total_updates - self.warmup_updates, 1)
        progress = min(max((update - self.warmup_updates) / span, 0.0), 1.0)
        if self.decay == "linear":
            return 1.0 - (1.0 - self.min_ratio) * progress
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
