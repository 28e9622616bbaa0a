"""How far generation may run ahead of training: the dispatch rule of every decoupled mode, in one place.

A rollout rank *starts* a sample when it admits the sample's request to its engine. A trainer shard
*retires* a sample when it trains on it for the first time, or when it evicts it unused because it went
stale. A mode bounds the samples started with one or both of two limits:

  window     started - retired <= window = (steps_ahead + 1) x batch, over all rollout ranks.
             The bound on work ahead of the trainer used by verl's one-step-off and fully-async
             recipes, AReaL (max_head_offpolicyness) and the Tinker cookbook (sampling_steps_ahead):
             in flight plus finished-and-waiting never exceeds steps_ahead batches beyond the one the
             trainer is on, and generation goes on while the trainer trains.
  per_step   started <= per_step x (trainer steps done since the run started or resumed + 1). The
             ReFlow paper's B_max: every trainer
             step lets B_max more samples start, whatever that step consumed, so generation runs ahead
             of the trainer whenever replay lowers fresh consumption.

Both limits are kept per (rollout rank, trainer shard) pair, in whole GRPO groups: a group's destination
shard is chosen when the group is admitted, among the pairs with room. Every shard therefore owns a fixed
share of each limit, and the no-deadlock argument in ``reflow.modes.decoupled`` holds shard by shard, not
only in total (a shard cannot sit empty while another one's surplus fills the window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class DispatchRule:
    """The limits of one mode, in samples over all rollout ranks; 0 switches a limit off."""

    window: int = 0
    """Most samples started but not yet retired (consumed for the first time, or evicted unused)."""
    per_step: int = 0
    """Samples that may start per trainer step (B_max); the first step's share is available at once."""

    def __post_init__(self):
        if self.window < 0 or self.per_step < 0:
            raise ValueError(f"dispatch limits must be >= 0, got window={self.window} per_step={self.per_step}")
        if not self.window and not self.per_step:
            raise ValueError("a dispatch rule needs a window or a per-step limit (or both)")

    def describe(self) -> str:
        parts = []
        if self.window:
            parts.append(f"at most {self.window} samples started and not yet trained")
        if self.per_step:
            parts.append(f"{self.per_step} samples started per trainer step")
        return "; ".join(parts)


def share_groups(total_groups: int, num_rollout: int, num_shards: int) -> list[list[int]]:
    """Split whole groups over (rollout rank, shard) pairs: ``shares[r][a]`` groups.

    The k-th group goes to shard k mod A from rollout rank (k + k div L) mod R, L = lcm(R, A): any two
    shards' totals differ by at most one group, so do any two rollout ranks' totals, and the shift by
    k div L lets every rollout rank feed every shard when there are enough groups (with R = A = 2, plain
    k mod R would tie rollout rank 0 to shard 0 for good)."""
    lcm = num_rollout * num_shards // math.gcd(num_rollout, num_shards)
    shares = [[0] * num_shards for _ in range(num_rollout)]
    for k in range(total_groups):
        shares[(k + k // lcm) % num_rollout][k % num_shards] += 1
    return shares


class DispatchBudget:
    """One rollout rank's budget: may it start another group now, and for which trainer shard?

    Counts are cumulative and in samples. ``update`` takes the trainer's latest word (steps done, and how
    many of this rank's samples each shard has retired); being cumulative, a late or repeated word is
    harmless. ``start_step`` is the step the run resumed at (0 for a new run)."""

    def __init__(
        self, rule: DispatchRule, rollout_index: int, num_rollout: int, num_shards: int, group_size: int, start_step: int = 0
    ):
        if not 0 <= rollout_index < num_rollout:
            raise ValueError(f"rollout index {rollout_index} outside [0, {num_rollout})")
        self.rule = rule
        self.group_size = group_size
        self.num_shards = num_shards
        self.start_step = start_step
        self.window_share = self._share(rule.window, rollout_index, num_rollout)
        self.step_share = self._share(rule.per_step, rollout_index, num_rollout)
        self.started = [0] * num_shards
        self.retired = [0] * num_shards
        self.steps_done = start_step
        self._next_shard = rollout_index % num_shards  # rollout ranks start on different shards

    def _share(self, limit: int, rollout_index: int, num_rollout: int) -> list[int] | None:
        if not limit:
            return None
        groups = share_groups(limit // self.group_size, num_rollout, self.num_shards)[rollout_index]
        return [g * self.group_size for g in groups]

    def update(self, steps_done: int, retired: Sequence[int]) -> None:
        if len(retired) != self.num_shards:
            raise ValueError(f"retired counts for {len(retired)} shards, expected {self.num_shards}")
        self.steps_done = max(self.steps_done, steps_done)
        self.retired = [max(old, new) for old, new in zip(self.retired, retired)]

    def allowance(self, shard: int) -> int:
        """Samples this rank may have started for ``shard`` by now."""
        limits = []
        if self.window_share is not None:
            limits.append(self.retired[shard] + self.window_share[shard])
        if self.step_share is not None:
            limits.append(self.step_share[shard] * (self.steps_done - self.start_step + 1))
        return min(limits)

    def room(self, shard: int) -> int:
        return self.allowance(shard) - self.started[shard]

    def outstanding(self, shard: int) -> int:
        """Started for ``shard`` and not yet retired (in flight, in transit or waiting in the shard)."""
        return self.started[shard] - self.retired[shard]

    def next_shard(self) -> int | None:
        """The shard the next group goes to (round robin over shards with room for a whole group), or None."""
        for k in range(self.num_shards):
            shard = (self._next_shard + k) % self.num_shards
            if self.room(shard) >= self.group_size:
                return shard
        return None

    def record_start(self, shard: int) -> None:
        if self.room(shard) < self.group_size:
            raise RuntimeError(f"no room for a group on shard {shard}: the caller must ask next_shard() first")
        self.started[shard] += self.group_size
        self._next_shard = (shard + 1) % self.num_shards
