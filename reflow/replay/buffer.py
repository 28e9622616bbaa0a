"""One shard of the replay buffer (each trainer rank owns one).

A sample enters *unused* (fresh). A batch of size b takes

    n_fresh  = min(#eligible unused, b)                         needs n_fresh >= ceil(b * (1 - sigma))
    n_replay = min(b - n_fresh, floor(b * sigma), #replayable)

and the trainer waits (``can_serve`` is False) until n_fresh + n_replay = b: a batch holds exactly b
samples, the replay fraction is 0 whenever production keeps up and at most sigma otherwise. Unused samples
are taken earliest deadline first: the oldest anchor version (below), ties by arrival. After the step a replay
filter decides which consumed samples return to the pool as replayable.

Staleness is counted from an *anchor* version, the mode's choice (``replay.staleness_from``):

  finish   the version at which the sample's group finished (verl's fully-async stamps it so): a long answer
           started under an old policy is as fresh as a short one when both arrive together. Its per-token
           versions still feed truncated importance sampling, and tokens older than replay.max_head_lag
           versions are masked out of the loss (``reflow.trainer.batch.mask_stale_tokens``).
  start    the version that produced its oldest token (its birth).

A sample is evicted once its staleness exceeds delta (``evict_stale``, before every batch). With
``min_staleness`` = m > 0 an unused sample is only eligible once its staleness reaches
min(m, current - start_version): ``one_step_off`` (m = 1, anchor start) trains the batch the previous policy
generated, never the one the current policy is generating; at the version a run starts (or resumes) at,
nothing can be older, hence the min.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from reflow.replay.policies import ReplayFilter, Sampler
from reflow.types import Sample

BufferedSample = Sample
"""The name checkpoints written before ``reflow.types`` pickled their samples under (they still load)."""


@dataclass
class BatchPlan:
    fresh: list[Sample]
    replayed: list[Sample]

    @property
    def size(self) -> int:
        return len(self.fresh) + len(self.replayed)

    @property
    def replay_fraction(self) -> float:
        return len(self.replayed) / self.size if self.size else 0.0


def min_fresh(batch_size: int, sigma: float) -> int:
    """Unused samples a batch needs before the trainer may step: ceil(b (1 - sigma))."""
    return math.ceil(batch_size * (1.0 - sigma) - 1e-9)


def max_replay(batch_size: int, sigma: float) -> int:
    return math.floor(batch_size * sigma + 1e-9)


STALENESS_ANCHORS = ("finish", "start")


class ReplayBuffer:
    def __init__(
        self, sigma: float, delta: int, sampler: Sampler, replay_filter: ReplayFilter, seed: int = 0, min_staleness: int = 0,
        anchor: str = "finish",
    ):
        if not 0.0 <= sigma < 1.0:
            raise ValueError(f"replay.sigma must be in [0, 1), got {sigma}")
        if delta < 0:
            raise ValueError(f"replay.delta must be >= 0, got {delta}")
        if not 0 <= min_staleness <= delta:
            raise ValueError(f"min_staleness must be in [0, delta = {delta}], got {min_staleness}")
        if anchor not in STALENESS_ANCHORS:
            raise ValueError(f"replay.staleness_from must be one of {STALENESS_ANCHORS}, got {anchor!r}")
        self.sigma = sigma
        self.delta = delta
        self.anchor = anchor
        self.min_staleness = min_staleness
        self.start_version = 0
        """The policy version this run (or resumed run) started at: no sample can be older than it."""
        self.sampler = sampler
        self.filter = replay_filter
        self.rng = random.Random(seed)
        self.unused: list[Sample] = []
        self.replayable: list[Sample] = []
        self.num_evicted = 0

    # ---- in ----------------------------------------------------------------------

    def add(self, samples: list[Sample]) -> None:
        """New samples enter unused; samples handed over from another shard keep their state."""
        for s in samples:
            (self.unused if s.use_count == 0 else self.replayable).append(s)

    # ---- out ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.unused) + len(self.replayable)

    @property
    def num_unused(self) -> int:
        return len(self.unused)

    def staleness(self, sample: Sample, version: int) -> int:
        return sample.staleness(version, self.anchor)

    def _eligible_in_arrival_order(self, version: int) -> list[Sample]:
        floor = min(self.min_staleness, version - self.start_version)
        if floor <= 0:
            return self.unused
        newest, anchor = version - floor, self.anchor  # staleness >= floor: an anchor version at most this
        return [sample for sample in self.unused if sample.anchor_version(anchor) <= newest]

    def _eligible(self, version: int) -> list[Sample]:
        """Unused samples it may train at ``version``, earliest deadline first (anchor version, then arrival)."""
        eligible = self._eligible_in_arrival_order(version)
        return sorted(eligible, key=lambda s: s.anchor_version(self.anchor))  # stable: ties keep arrival order

    def num_eligible(self, version: int) -> int:
        return len(self._eligible_in_arrival_order(version))  # (counts need no order: the trainer asks every 2 ms)

    def need(self, batch_size: int) -> int:
        """Eligible unused samples a batch of exactly ``batch_size`` needs: at least ceil(b(1 - sigma)), and
        whatever the replayable pool cannot fill of the rest."""
        usable_replay = min(max_replay(batch_size, self.sigma), len(self.replayable))
        return max(min_fresh(batch_size, self.sigma), batch_size - usable_replay)

    def can_serve(self, batch_size: int, version: int) -> bool:
        return self.num_eligible(version) >= self.need(batch_size)

    def plan_batch(self, batch_size: int, version: int) -> BatchPlan | None:
        """Take a batch of exactly ``batch_size`` at policy ``version`` (eligible unused samples earliest deadline
        first, then replayed ones); None if the trainer has to wait."""
        if not self.can_serve(batch_size, version):
            return None
        fresh = self._eligible(version)[:batch_size]
        taken = {id(s) for s in fresh}
        self.unused = [s for s in self.unused if id(s) not in taken]
        n_replay = min(batch_size - len(fresh), max_replay(batch_size, self.sigma), len(self.replayable))
        chosen = self.sampler.select(self.replayable, n_replay, self.rng) if n_replay > 0 else []
        ids = {id(s) for s in chosen}
        self.replayable = [s for s in self.replayable if id(s) not in ids]
        return BatchPlan(fresh=fresh, replayed=chosen)

    def num_urgent(self, version: int) -> int:
        """Eligible unused samples at their last version: staleness delta, evicted after this step unless trained."""
        return sum(1 for s in self._eligible_in_arrival_order(version) if self.staleness(s, version) >= self.delta)

    def take_eligible(self, first: int, count: int, version: int) -> list[Sample]:
        """Remove and return ``count`` eligible unused samples from position ``first`` of the earliest-deadline
        order (-1: the last ``count``, the latest deadlines); for moves between shards
        (``reflow.scheduler.routing.plan_moves``)."""
        eligible = self._eligible(version)
        start = len(eligible) - count if first < 0 else first
        if count < 0 or start < 0 or start + count > len(eligible):
            raise RuntimeError(f"asked for {count} eligible samples from position {first}, the shard holds {len(eligible)}")
        given = eligible[start : start + count]
        ids = {id(s) for s in given}
        self.unused = [s for s in self.unused if id(s) not in ids]
        return given

    def give_back(self, plan: BatchPlan) -> int:
        """After the step: consumed samples the filter accepts become replayable. Returns how many."""
        kept = 0
        for s in plan.fresh + plan.replayed:
            s.use_count += 1
            if self.filter.keep(s):
                self.replayable.append(s)
                kept += 1
        return kept

    def is_stale(self, sample: Sample, current_version: int) -> bool:
        return self.staleness(sample, current_version) > self.delta

    def evict_stale(self, current_version: int) -> list[Sample]:
        """Drop samples more than delta versions past their anchor; returns them (``use_count == 0``: never trained)."""
        gone = [s for s in self.unused + self.replayable if self.is_stale(s, current_version)]
        if gone:
            self.unused = [s for s in self.unused if not self.is_stale(s, current_version)]
            self.replayable = [s for s in self.replayable if not self.is_stale(s, current_version)]
            self.num_evicted += len(gone)
        return gone

    def drain(self) -> list[Sample]:
        """Remove and return every sample (a leaving trainer rank hands its shard over)."""
        out = self.unused + self.replayable
        self.unused, self.replayable = [], []
        return out
