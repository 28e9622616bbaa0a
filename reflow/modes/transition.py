"""A placement change of a decoupled run, on every rank after the step it follows (a sync point, where the
trainer ranks left their loop and rank 0 sent every rollout worker ``Transition``; the rollout workers hold
what they had in flight as partial rollouts, ``HeldGroup``). Why it cannot deadlock:
``docs/decoupled_protocol.md``, "Placement changes".

  1. rollout workers send FLUSH to every trainer rank; trainer ranks drain until they have FLUSH from every
     rollout worker, so each shard holds every sample addressed to it, and until every move has arrived
  2. the trainer resizes (staying ranks keep their shards, joining ranks receive theirs)
  3. leaving trainer shards hand their buffer to the staying shard of index (their index mod A'); nothing
     else can reach them: every group sent before the change arrived before FLUSH
  4. every rank learns the trainer's clock, how far each rollout worker drew the prompt stream and what it
     holds; the held groups are dealt by ``deal_groups``: a staying worker keeps its own, a leaving worker's
     go to the new workers holding the fewest sequences

The caller then takes up the new placement's roles (prompt shares dealt without a gap, shards, budgets) and
runs the new placement's weight sync, which puts the current weights into every engine that now generates.

Who goes where is ``ChangePlan``, pure and shared with the simulator; ``change_placement`` runs steps 1-4
on one rank over explicit state (``RankState``) and its links to the others (``PlacementLinks``: the data
plane and two collectives), so it knows nothing of the mode that calls it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

from reflow.distributed.placement import Placement, build_placement
from reflow.modes.trainer_shard import TrainerShard
from reflow.scheduler.routing import deal_groups
from reflow.types import Handover, HeldGroup


@dataclass(frozen=True)
class ChangePlan:
    """Who goes where when ``old`` becomes ``new`` (the trainer grows from rank 0 up; rollout ranks are the rest)."""

    old: Placement
    new: Placement

    @classmethod
    def to(cls, old: Placement, replicas: int) -> "ChangePlan":
        new = build_placement(old.world_size, replicas, old.shard_degree, old.world_size - replicas * old.shard_degree,
                              rollout_tp=old.rollout_tp)
        return cls(old, new)

    def joins_trainer(self, rank: int) -> bool:
        """Trains from now on and generates no more (its engine sleeps before the shards arrive)."""
        return not self.old.is_trainer(rank) and self.new.is_trainer(rank) and not self.new.is_rollout(rank)

    def leaves_trainer(self, rank: int) -> bool:
        return self.old.is_trainer(rank) and not self.new.is_trainer(rank)

    def heir(self, shard_index: int) -> int:
        """The new trainer shard that takes a leaving shard's buffer: its index mod A'."""
        return shard_index % self.new.num_trainer_ranks

    def deal(self, held: list[list[HeldGroup]]) -> list[list[HeldGroup]]:
        """Each old rollout worker's held groups (by worker index) dealt to the new workers (by index): a staying
        worker keeps its own, a leaving one's go to the workers holding the fewest sequences."""
        old, new = self.old.rollout_workers, self.new.rollout_workers
        stays = [new.index(rank) if rank in new else None for rank in old]
        dealt = deal_groups([[len(group.held) for group in groups] for groups in held], stays, len(new))
        return [[held[worker][k] for worker, k in mine] for mine in dealt]


def take_up_shard(shard: TrainerShard | None, placement: Placement, rank: int, batch_per_shard: int,
                  new_shard: Callable[[], TrainerShard]) -> TrainerShard:
    """A trainer rank's shard in ``placement``: the one it kept through a change, at its index in the new trainer
    group and with budgets that start afresh (no sample it holds counts against the new ones), or ``new_shard()``
    where it had none (at start-up, or having joined the trainer)."""
    if shard is None:
        return new_shard()
    shard.rejoin(placement.trainer_ranks.index(rank), batch_per_shard, len(placement.rollout_workers))
    return shard


@dataclass
class TrainerClock:
    """Where the run is; trainer rank 0's copy is everyone's after a change (a rank that generated counted no
    steps)."""

    step: int
    version: int
    steps_done: int
    drawn: int
    """How far the trainer's first uses drew the prompt stream."""


@dataclass
class RankState:
    """What a placement change reads and rewrites on one rank."""

    clock: TrainerClock
    shard: TrainerShard | None
    """This rank's trainer shard (None on a rank that only generates)."""
    shares: list | None
    """Every rollout worker's prompt share (``reflow.modes.prompts``)."""
    carried: list[HeldGroup]
    """This rank's rollout worker's held groups (partial rollouts)."""


class PlacementLinks(Protocol):
    """One rank's links to the others during a change."""

    def flush(self, trainer_ranks: list[int]) -> None:
        """A rollout worker: FLUSH to every trainer rank, behind every sample it sent."""

    def drain(self, rollout_workers: list[int]) -> None:
        """A trainer rank: receive until FLUSH came from every rollout worker and every move arrived."""

    def hand_over(self, heir_rank: int, handover: Handover) -> None:
        """A leaving shard's buffer, to the rank of its heir."""

    def broadcast(self, values: list[int]) -> list[int]:
        """Trainer rank 0's values (rank 0 trains in every placement), on every rank."""

    def all_gather(self, value) -> list:
        """Every rank's ``value``, by rank."""


def change_placement(plan: ChangePlan, rank: int, state: RankState, links: PlacementLinks, engine, trainer,
                     bucket_bytes: int) -> tuple[RankState, object]:
    """Steps 1-4 on this rank; returns its new state and the trainer's resize report (``bytes_moved``,
    ``direction``)."""
    old, new = plan.old, plan.new
    # 1. flush the data plane into the shards (a tensor-parallel engine's followers sent nothing: they skip this)
    if rank in old.rollout_workers:
        links.flush(old.trainer_ranks)
    elif old.is_trainer(rank):
        links.drain(old.rollout_workers)
    # 2. the trainer's shards; a rank that joins the trainer puts its engine to sleep first (nothing is in flight:
    #    its worker held everything), so that the shards it receives find the engine's memory free
    if plan.joins_trainer(rank):
        engine.sleep()
    resized = trainer.resize(new.replicate_degree, bucket_bytes=bucket_bytes)
    # 3. a leaving shard's samples go to a staying one (use counts and versions kept)
    shard = state.shard
    if plan.leaves_trainer(rank):
        samples, draws = shard.hand_over()
        links.hand_over(new.trainer_ranks[plan.heir(shard.index)], Handover(samples, draws))
        shard = None
    # 4. the trainer's clock, the prompt shares as the rollout workers left them, and the held groups, dealt
    c = state.clock
    clock = TrainerClock(*links.broadcast([c.step, c.version, c.steps_done, c.drawn]))
    mine = (state.shares[old.rollout_workers.index(rank)], state.carried) if rank in old.rollout_workers else None
    gathered = links.all_gather(mine)
    shares = [gathered[r][0] for r in old.rollout_workers]
    dealt = plan.deal([gathered[r][1] for r in old.rollout_workers])
    carried = dealt[new.rollout_workers.index(rank)] if rank in new.rollout_workers else []
    return dataclasses.replace(state, clock=clock, shard=shard, shares=shares, carried=carried), resized
