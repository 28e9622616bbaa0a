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

Both limits are kept per trainer shard, in whole GRPO groups: every shard owns a fixed share of each limit,
so the no-deadlock argument in ``reflow.modes.decoupled`` holds shard by shard, not only in total (a shard
cannot sit empty while another one's surplus fills the window). Which rollout rank starts a shard's groups
is decided one of two ways:

  fixed      every (rollout rank, shard) pair owns a fixed share (``share_groups``); a rank's
             ``DispatchBudget`` computes its room from the trainer's counts. one_step_off relies on it (a
             step's room is admitted at once, on the rank that owns it).
  dealt      with scheduler.kv_admission (async and reflow): trainer rank 0's ``GroupDispatcher`` deals each
             shard's room group by group to the rank with the most KV headroom (the fast dispatcher, global
             over the rollout ranks), and a rank's budget starts what it was granted.

Either way a group's destination shard is fixed when the group is admitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from reflow.scheduler.concurrency import WorkerLoad


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


def limit_shares(limit: int, group_size: int, rollout_index: int, num_rollout: int, num_shards: int) -> list[int] | None:
    """Rollout rank ``rollout_index``'s share of one limit per shard, in samples of whole groups (None: no
    such limit); with one rollout rank, each shard's share of the whole limit."""
    if not limit:
        return None
    return [g * group_size for g in share_groups(limit // group_size, num_rollout, num_shards)[rollout_index]]


def rule_allowance(window_share: list[int] | None, step_share: list[int] | None, shard: int, retired: int, steps: int) -> int:
    """Samples that may have started for ``shard`` under both limits: the window share past the ``retired``
    samples, and the per-step share for each of ``steps`` steps (those done since the start, plus one)."""
    limits = []
    if window_share is not None:
        limits.append(retired + window_share[shard])
    if step_share is not None:
        limits.append(step_share[shard] * steps)
    return min(limits)


class DispatchBudget:
    """One rollout rank's budget: may it start another group now, and for which trainer shard?

    Fixed (the default): the rank owns a fixed share of each limit (``share_groups``). Dealt: the global
    ``GroupDispatcher`` on trainer rank 0 deals the room group by group to the workers with KV headroom, and
    the rank may start what it was granted (``grant``). Counts are cumulative and in samples. ``update`` takes the trainer's latest word (steps done, and how
    many of this rank's samples each shard has retired); being cumulative, a late or repeated word is
    harmless. ``start_step`` is the step the run resumed at (0 for a new run)."""

    def __init__(
        self, rule: DispatchRule, rollout_index: int, num_rollout: int, num_shards: int, group_size: int, start_step: int = 0,
        dealt: bool = False,
    ):
        if not 0 <= rollout_index < num_rollout:
            raise ValueError(f"rollout index {rollout_index} outside [0, {num_rollout})")
        self.rule = rule
        self.group_size = group_size
        self.num_shards = num_shards
        self.start_step = start_step
        self.window_share = limit_shares(rule.window, group_size, rollout_index, num_rollout, num_shards)
        self.step_share = limit_shares(rule.per_step, group_size, rollout_index, num_rollout, num_shards)
        self.started = [0] * num_shards
        self.retired = [0] * num_shards
        self.steps_done = start_step
        self._next_shard = rollout_index % num_shards  # rollout ranks start on different shards
        self.granted: list[int] | None = [0] * num_shards if dealt else None

    def update(self, steps_done: int, retired: Sequence[int]) -> None:
        if len(retired) != self.num_shards:
            raise ValueError(f"retired counts for {len(retired)} shards, expected {self.num_shards}")
        self.steps_done = max(self.steps_done, steps_done)
        self.retired = [max(old, new) for old, new in zip(self.retired, retired)]

    def allowance(self, shard: int) -> int:
        """Samples this rank may have started for ``shard`` by now: its grants when dealt, else its fixed share."""
        if self.granted is not None:
            return self.granted[shard]
        return rule_allowance(self.window_share, self.step_share, shard, self.retired[shard], self.steps_done - self.start_step + 1)

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

    def grant(self, granted: Sequence[int]) -> None:
        """A dealt budget's word from the global dispatcher: samples granted per shard so far (cumulative)."""
        if self.granted is None:
            raise RuntimeError("grant() is for a budget the global dispatcher deals (DispatchBudget(..., dealt=True))")
        if len(granted) != self.num_shards:
            raise ValueError(f"grants for {len(granted)} shards, expected {self.num_shards}")
        self.granted = [max(old, new) for old, new in zip(self.granted, granted)]


@dataclass(frozen=True)
class WorkerReport:
    """A rollout worker's state as the global dispatcher sees it (from the worker's latest report)."""

    load: WorkerLoad
    group_estimate: float
    """T_hat: KV tokens the worker expects its next group to reach."""
    started: int
    """Samples the worker has started in this placement (cumulative, like the grants)."""


class GroupDispatcher:
    """The global fast dispatcher: deals the mode's dispatch room to the rollout workers, one group at a time.

    The mode's rule fixes, per trainer shard, how many samples may have started by now (``allowance``: the
    shard's share of the window past its retirements, and of B_max per step), as ``DispatchBudget`` does per
    (rollout rank, shard) pair; here the per-shard totals stay fixed and only *which worker* starts each
    group is decided, when the room appears. A group goes to the worker whose predicted KV tokens, plus the
    groups granted to it and not started yet, plus this group's estimate, are the smallest fraction of its KV
    budget, among the workers within rho and their concurrency cap; when none is, to the least loaded one
    (its admission gate then holds the group until there is room: room is never withheld, which is what the
    no-deadlock argument needs). A worker not heard from yet counts as empty, so the first groups go round.

    Grants are cumulative samples per (worker, shard): a worker's ``DispatchBudget(dealt=True)`` may start
    what it was granted, never more, so every shard's total obeys the rule exactly as with fixed shares."""

    def __init__(self, rule: DispatchRule, num_rollout: int, num_shards: int, group_size: int, rho: float, start_step: int = 0):
        if not 0 < rho <= 2:
            raise ValueError(f"rho must be in (0, 2], got {rho}")
        self.rule, self.group_size, self.rho, self.start_step = rule, group_size, rho, start_step
        self.num_rollout, self.num_shards = num_rollout, num_shards
        self.window_share = limit_shares(rule.window, group_size, 0, 1, num_shards)
        self.step_share = limit_shares(rule.per_step, group_size, 0, 1, num_shards)
        self.granted = [[0] * num_shards for _ in range(num_rollout)]
        self.reports: list[WorkerReport | None] = [None] * num_rollout
        self._next_shard = 0

    def report(self, worker: int, report: WorkerReport) -> None:
        self.reports[worker] = report

    def allowance(self, shard: int, steps_done: int, retired: int) -> int:
        """Samples all workers together may have started for ``shard`` once ``retired`` of them are retired."""
        return rule_allowance(self.window_share, self.step_share, shard, retired, steps_done - self.start_step + 1)

    def _pending_groups(self, worker: int) -> int:
        report = self.reports[worker]
        started = report.started if report is not None else 0
        return max(0, sum(self.granted[worker]) - started) // self.group_size

    def _projected(self, worker: int) -> tuple[float, bool]:
        """(KV fraction the worker reaches with one more group, whether that stays within rho and its cap)."""
        pending = self._pending_groups(worker)
        report = self.reports[worker]
        if report is None:
            return float(pending + 1), pending == 0
        load = report.load
        tokens = load.predicted_tokens + (pending + 1) * report.group_estimate
        fraction = tokens / max(load.kv_budget_tokens, 1)
        empty = load.in_flight == 0 and pending == 0
        fits = empty or (load.in_flight + (pending + 1) * self.group_size <= load.cap and fraction <= self.rho)
        return fraction, fits

    def choose(self) -> int:
        """The worker the next group goes to."""
        scored = [(not fits, fraction, self._pending_groups(w), w) for w in range(self.num_rollout) for fraction, fits in [self._projected(w)]]
        return min(scored)[3]

    def deal(self, steps_done: int, retired: Sequence[Sequence[int]]) -> list[list[int]]:
        """Deal whatever room the rule now allows, group by group (shards in turn); ``retired[worker][shard]``
        are cumulative retirements. Returns the cumulative grants per (worker, shard)."""
        room = [
            self.allowance(shard, steps_done, sum(row[shard] for row in retired)) - sum(g[shard] for g in self.granted)
            for shard in range(self.num_shards)
        ]
        while any(r >= self.group_size for r in room):
            shard = self._next_shard
            self._next_shard = (shard + 1) % self.num_shards
            if room[shard] < self.group_size:
                continue
            self.granted[self.choose()][shard] += self.group_size
            room[shard] -= self.group_size
        return [list(row) for row in self.granted]
