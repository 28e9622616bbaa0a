"""Which trainer shard a finished group goes to, and how shards even out when one would otherwise wait.

A group is bound to a trainer shard when it *arrives*, not when it is admitted: a long-tail group admitted
early must not hold a place in one shard while another shard starves, and a shard's surplus must not age out
of its staleness bound while another waits. Two pieces, both pure Python:

  ``ShardRouter``     a rollout worker's choice for each finished group: the shard with the fewest unused
                      samples, as trainer rank 0 last counted them (carried in Progress) plus what this worker
                      has sent it since. Several workers choose on counts a moment old, so their choices are
                      good, not exact;
  ``plan_moves``      what makes the no-deadlock and no-waste arguments independent of that: every trainer
                      rank computes the same moves from the same all-reduced counts. When some shard cannot
                      serve its batch while others hold more eligible samples than their own batch needs,
                      donors send their latest-deadline surplus to the shards short of samples; when a shard
                      holds more samples at their last version than one step trains, it sends the overflow to
                      shards whose batch has room for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class ShardRouter:
    """One rollout worker's destination for each finished group (whole groups, so a group trains together)."""

    def __init__(self, num_shards: int, first: int = 0):
        self.num_shards = num_shards
        self.known = [0] * num_shards
        """Unused samples per shard, as the latest Progress counted them."""
        self.sent_since = [0] * num_shards
        """Samples this worker sent each shard since that count."""
        self._next = first % num_shards  # ties go round robin, from a different shard on every worker

    def update(self, unused: Sequence[int] | None) -> None:
        """Trainer rank 0's latest count of unused samples per shard (None: no count in that word)."""
        if unused is None:
            return
        if len(unused) != self.num_shards:
            raise ValueError(f"unused counts for {len(unused)} shards, expected {self.num_shards}")
        if list(unused) != self.known:
            self.known = list(unused)
            self.sent_since = [0] * self.num_shards

    def choose(self, size: int) -> int:
        """The shard a finished group of ``size`` samples goes to; it counts as sent there."""
        order = [(self._next + k) % self.num_shards for k in range(self.num_shards)]
        shard = min(order, key=lambda a: self.known[a] + self.sent_since[a])
        self.sent_since[shard] += size
        self._next = (shard + 1) % self.num_shards
        return shard


@dataclass(frozen=True)
class ShardCounts:
    """One shard's counts in a readiness exchange."""

    eligible: int
    """Unused samples it may train now (staleness within the bounds), received or on their way to it."""
    need: int
    """Unused samples it needs for a batch of exactly b: max(ceil(b(1 - sigma)), b - its usable replay)."""
    urgent: int = 0
    """Eligible samples at their last version: trained in this step, or evicted after it."""
    batch: int = 0
    """Its batch (b/A): the most fresh samples one step takes."""


@dataclass(frozen=True)
class Move:
    donor: int
    receiver: int
    count: int
    first: int = -1
    """Where the donor's samples start in its earliest-deadline order when the move is applied (moves apply in
    the order planned); -1: its latest-deadline ones."""


def plan_moves(shards: Sequence[ShardCounts]) -> list[Move]:
    """Moves of eligible unused samples between shards, the same on every trainer rank for the same counts.

    1. Short shards first: a shard that cannot serve a batch gets what it lacks from the others' surplus beyond
       their own need (a donor stays ready, a receiver gets no more than it lacks), served in index order from
       the donor with the largest surplus (ties: lower index); the donors send their latest-deadline samples.
       Partial moves are made too: a shard that still lacks afterwards is topped up by later arrivals.
    2. Then, when no shard is short: a shard holding more urgent samples (at their last version) than one
       step trains sends the overflow, the urgent samples after its first ``batch`` in deadline order, to the
       shards with room for urgent samples in their own batch (in index order), so that the b earliest deadlines
       over all shards train first, as if the shards were one buffer."""
    moves = _serve_short_shards(shards)
    return moves or _spread_urgent(shards)


def _serve_short_shards(shards: Sequence[ShardCounts]) -> list[Move]:
    surplus = [max(0, s.eligible - s.need) for s in shards]
    moves = []
    for receiver, counts in enumerate(shards):
        lacking = counts.need - counts.eligible
        while lacking > 0:
            donor = max(range(len(shards)), key=lambda a: (surplus[a], -a))
            if surplus[donor] == 0:
                return moves
            count = min(lacking, surplus[donor])
            moves.append(Move(donor, receiver, count))
            surplus[donor] -= count
            lacking -= count
    return moves


def _spread_urgent(shards: Sequence[ShardCounts]) -> list[Move]:
    room = [max(0, s.batch - s.urgent) for s in shards]
    moves = []
    for donor, counts in enumerate(shards):
        overflow = counts.urgent - counts.batch
        for receiver in range(len(shards)):
            if overflow <= 0:
                break
            count = min(overflow, room[receiver])
            if count > 0:  # (applied in order: each move takes what follows the donor's own batch then)
                moves.append(Move(donor, receiver, count, first=counts.batch))
                room[receiver] -= count
                overflow -= count
    return moves


def deal_groups(held: Sequence[Sequence[int]], stays: Sequence[int | None], num_new: int) -> list[list[tuple[int, int]]]:
    """A placement change's partial rollouts: ``held[w]`` lists the sizes (sequences in flight) of the groups
    old rollout worker w holds; ``stays[w]`` is its index among the new rollout workers, or None when it
    leaves. A staying worker keeps its groups; a leaving worker's groups go, one by one, to the new worker
    holding the fewest sequences (ties: the lowest index). Returns, per new worker, (old worker, group
    position) of every group it resumes, its own first."""
    dealt: list[list[tuple[int, int]]] = [[] for _ in range(num_new)]
    load = [0] * num_new
    for worker, new in enumerate(stays):
        if new is not None:
            dealt[new].extend((worker, k) for k in range(len(held[worker])))
            load[new] += sum(held[worker])
    if num_new == 0:
        if any(held[worker] for worker, new in enumerate(stays) if new is None):
            raise ValueError("partial rollouts to hand over, but no rollout worker in the new placement")
        return dealt
    for worker, new in enumerate(stays):
        if new is None:
            for k, size in enumerate(held[worker]):
                target = min(range(num_new), key=lambda r: (load[r], r))
                dealt[target].append((worker, k))
                load[target] += size
    return dealt
