"""How far generation may run ahead of training: the dispatch rule of every decoupled mode, in one place.

A rollout worker *starts* a sample when it admits the sample's request to its engine. A trainer shard
*retires* a sample when it trains on it for the first time, or when it evicts it unused. A mode bounds the
samples started with one or two limits, both over all trainer shards together, in whole GRPO groups:

  window     started - retired <= window = (steps_ahead + 1) x batch. Every decoupled mode has one: the
             bound on work ahead of the trainer of verl's one-step-off and fully-async recipes, AReaL
             (max_head_offpolicyness) and the Tinker cookbook (sampling_steps_ahead). In flight plus
             finished-and-waiting never exceeds steps_ahead batches beyond the one the trainer is on, so what
             is generated is tied to what is retired, and nothing piles up to go stale.
  per_step   at most per_step samples start between two consecutive trainer steps (reflow's B_max, "an
             upper bound B_max on the samples dispatched at each step"). Credit a step leaves unused
             expires at the next step: it never accumulates.

With DAPO's dynamic sampling (reward.dynamic_sampling) a trainer shard drops a group whose rewards are all
equal the moment it arrives: its samples are *filtered*, retired at once (evicted unused, cause "no_signal"),
so they leave the window like any retirement. The per-step limit counts started samples *less the filtered
ones*: a filtered sample gives its credit back, in the period in which the trainer reports it, so a step whose
fresh share needs more than B_max x (1 - filtered fraction) starts still fills (``docs/decoupled_protocol.md``
says why that cannot deadlock, and why the window still bounds what goes stale). Both counts, retired and
filtered, are cumulative per rollout worker and come from the trainer's readiness exchange.

Which trainer shard a group goes to is decided when it *finishes* (``reflow.scheduler.routing``), not here:
a group is bound to the shard that needs it when it arrives, so one shard's surplus never waits out its
staleness bound while another shard starves. Which rollout worker starts the next group is decided one of
two ways:

  fixed      every rollout worker owns a fixed share of each limit (``share_groups``); its
             ``DispatchBudget`` computes its room from the trainer's counts. one_step_off relies on it (a
             step's room is admitted at once, on the worker that owns it).
  dealt      with scheduler.kv_admission (async and reflow): trainer rank 0's ``GroupDispatcher`` deals the
             room group by group to the worker with the most KV headroom (the fast dispatcher), and a
             worker's budget starts what it was granted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from reflow.scheduler.concurrency import WorkerLoad


@dataclass(frozen=True)
class DispatchRule:
    """The limits of one mode, in samples over all rollout workers and trainer shards; per_step 0 is off."""

    window: int
    """Most samples started but not yet retired (consumed for the first time, or evicted unused)."""
    per_step: int = 0
    """Most samples that may start between two consecutive trainer steps (B_max); unused credit expires."""

    def __post_init__(self):
        if self.window <= 0:
            raise ValueError(f"a dispatch rule needs a window > 0, got window={self.window}")
        if self.per_step < 0:
            raise ValueError(f"dispatch limits must be >= 0, got per_step={self.per_step}")

    def describe(self) -> str:
        text = f"at most {self.window} samples started and not yet trained"
        if self.per_step:
            text += f"; at most {self.per_step} samples started per trainer step"
        return text


def share_groups(total_groups: int, num_rollout: int) -> list[int]:
    """Split whole groups over rollout workers: ``shares[r]`` groups, any two differing by at most one. A
    worker's share never shrinks when the total grows (the k-th group goes to worker k mod R)."""
    return [total_groups // num_rollout + (1 if r < total_groups % num_rollout else 0) for r in range(num_rollout)]


def limit_share(limit: int, group_size: int, rollout_index: int, num_rollout: int) -> int | None:
    """Worker ``rollout_index``'s share of one limit, in samples of whole groups (None: no such limit)."""
    if not limit:
        return None
    return share_groups(limit // group_size, num_rollout)[rollout_index] * group_size


class StepCredit:
    """The per-step limit's bookkeeping: how much has started (or been granted) since the latest trainer step,
    less what was filtered meanwhile.

    ``advance(steps_done, count)`` is told the trainer's steps with the current cumulative count (started or
    granted, minus filtered, so a filtered sample's credit comes back); a step the caller had not seen opens a
    new period whose base is that count, so a period's unused credit is gone. The caller passes the count
    *before* the word's new filtered samples: those reported with a new step refund the new period."""

    def __init__(self, start_step: int):
        self.steps_done = start_step
        self.base = 0

    def advance(self, steps_done: int, count: int) -> None:
        if steps_done > self.steps_done:
            self.steps_done = steps_done
            self.base = count

    def used(self, count: int) -> int:
        return count - self.base


class DispatchBudget:
    """One rollout worker's budget: may it start another group now?

    Fixed (the default): the worker owns a fixed share of each limit (``share_groups``). Dealt: the global
    ``GroupDispatcher`` on trainer rank 0 deals the room group by group to the workers with KV headroom, and
    the worker may start what it was granted (``grant``). Counts are in samples. ``update`` takes the
    trainer's latest word (steps done, and how many of this worker's samples the trainer has retired and, of
    those, filtered for carrying no signal, over all shards); being cumulative, a late or repeated word is
    harmless. ``start_step`` is the step the run (or the placement) started at."""

    def __init__(
        self, rule: DispatchRule, rollout_index: int, num_rollout: int, group_size: int, start_step: int = 0,
        dealt: bool = False,
    ):
        if not 0 <= rollout_index < num_rollout:
            raise ValueError(f"rollout index {rollout_index} outside [0, {num_rollout})")
        self.rule = rule
        self.group_size = group_size
        self.window_share = limit_share(rule.window, group_size, rollout_index, num_rollout)
        self.step_share = limit_share(rule.per_step, group_size, rollout_index, num_rollout)
        self.started = 0
        self.retired = 0
        self.filtered = 0
        """Of the retired samples, those dropped for carrying no signal (dynamic sampling): they refund B_max."""
        self.credit = StepCredit(start_step)
        self.granted: int | None = 0 if dealt else None

    def update(self, steps_done: int, retired: int, filtered: int = 0) -> None:
        self.credit.advance(steps_done, self.started - self.filtered)  # this word's filtered refund the new period
        self.retired = max(self.retired, retired)
        self.filtered = max(self.filtered, filtered)

    def room(self) -> int:
        """Samples this worker may start now: what it was granted when dealt, else its share of each limit."""
        if self.granted is not None:
            return self.granted - self.started
        room = self.retired + self.window_share - self.started
        if self.step_share is not None:
            room = min(room, self.step_share - self.started_this_step)
        return room

    def can_start(self) -> bool:
        return self.room() >= self.group_size

    @property
    def outstanding(self) -> int:
        """Started and not yet retired (in flight, in transit or waiting in a shard)."""
        return self.started - self.retired

    @property
    def started_this_step(self) -> int:
        """The per-step credit used: samples started since the latest step, less those filtered meanwhile."""
        return self.credit.used(self.started - self.filtered)

    def record_start(self) -> None:
        if not self.can_start():
            raise RuntimeError("no room for a group: the caller must ask can_start() first")
        self.started += self.group_size

    def grant(self, granted: int) -> None:
        """A dealt budget's word from the global dispatcher: samples granted to this worker so far (cumulative)."""
        if self.granted is None:
            raise RuntimeError("grant() is for a budget the global dispatcher deals (DispatchBudget(..., dealt=True))")
        self.granted = max(self.granted, granted)


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

    The mode's rule fixes how many samples may have started by now over all workers (``room``: the window
    past the retirements, and B_max since the latest step), as ``DispatchBudget`` does per worker; here only
    *which worker* starts each group is decided, when the room appears. A group goes to the worker whose
    predicted KV tokens, plus the groups granted to it and not started yet, plus this group's estimate, are the
    smallest fraction of its KV budget, among the workers within rho and their concurrency cap; when none is,
    to the least loaded one (its admission gate then holds the group until there is room: room is never
    withheld, which is what the no-deadlock argument needs). A worker not heard from yet counts as empty, so
    the first groups go round.

    Grants are cumulative samples per worker: a worker's ``DispatchBudget(dealt=True)`` may start what it was
    granted, never more, so the totals obey the rule exactly as with fixed shares. The per-step limit counts
    grants less filtered samples: at most B_max net of them are dealt between two trainer steps, and room not
    dealt by the next step expires."""

    def __init__(self, rule: DispatchRule, num_rollout: int, group_size: int, rho: float, start_step: int = 0):
        if not 0 < rho <= 2:
            raise ValueError(f"rho must be in (0, 2], got {rho}")
        self.rule, self.group_size, self.rho = rule, group_size, rho
        self.num_rollout = num_rollout
        self.granted = [0] * num_rollout
        self.reports: list[WorkerReport | None] = [None] * num_rollout
        self.credit = StepCredit(start_step)
        self.filtered = 0
        """Samples filtered for carrying no signal, over all workers (the latest word's): they refund B_max."""

    def report(self, worker: int, report: WorkerReport) -> None:
        self.reports[worker] = report

    def room(self, steps_done: int, retired: int, filtered: int = 0) -> int:
        """Samples all workers together may still be granted once ``retired`` of them are retired, ``filtered``
        of those for carrying no signal."""
        self.credit.advance(steps_done, sum(self.granted) - self.filtered)  # this word's filtered refund the new period
        self.filtered = max(self.filtered, filtered)
        room = retired + self.rule.window - sum(self.granted)
        if self.rule.per_step:
            room = min(room, self.rule.per_step - self.credit.used(sum(self.granted) - self.filtered))
        return room

    def _pending_groups(self, worker: int) -> int:
        report = self.reports[worker]
        started = report.started if report is not None else 0
        return max(0, self.granted[worker] - started) // self.group_size

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
        scored = [(not fits, fraction, self._pending_groups(w), w)
                  for w in range(self.num_rollout) for fraction, fits in [self._projected(w)]]
        return min(scored)[3]

    def deal(self, steps_done: int, retired: Sequence[int], filtered: Sequence[int] = ()) -> list[int]:
        """Deal whatever room the rule now allows, group by group; ``retired[worker]`` are cumulative
        retirements of each worker's samples, ``filtered[worker]`` those of them filtered for carrying no signal
        (empty: none). Returns the cumulative grants per worker."""
        room = self.room(steps_done, sum(retired), sum(filtered))
        while room >= self.group_size:
            self.granted[self.choose()] += self.group_size
            room -= self.group_size
        return list(self.granted)
