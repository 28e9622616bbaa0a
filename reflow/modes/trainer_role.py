"""The trainer's side of the decoupled modes as one role, which the live run and the simulator both drive.

A ``TrainerRole`` holds the trainer shards of one process (the live run: this rank's one shard; the simulator:
every shard) and plays the replay cycle's trainer side over protocols, with no process group, sleep or clock
inside:

  poll   one pass of the wait loop: evict what aged (once per version), exchange every shard's readiness
         (``ReadinessExchange``: gloo live, in process in the simulator), publish Progress through the
         leader where this process holds it, and make the moves ``TrainerView.moves`` asks for
         (``SampleMover``). READY when every shard can serve exactly b/A and no move is due (R3, R4).
  step   plan (fresh samples earliest deadline first, replayed ones up to sigma), the first-use advantage
         stage, train (``TrainerBackend``: ``PolicyTrainer`` live, the cost model in the simulator), retire
         the first uses, and at a sync point evict what the new version ages out and publish the weights
         (``WeightPublisher``); then exchange once more so the rollout workers learn the step's retirements.

What waits between polls (receiving messages live, ticking the simulated workers) and what a step's row
reports stay with the drivers: ``reflow.modes.decoupled`` and ``reflow.sim.system``. The rules the role keeps
(R1-R4) are told in ``docs/decoupled_protocol.md``.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol, Sequence

from reflow.modes.trainer_shard import TrainerShard
from reflow.replay.buffer import BatchPlan
from reflow.types import ReadinessExchange, Sample, ShardReadiness, TrainerView


class Poll(enum.Enum):
    READY = "ready"
    """Every shard can serve exactly b/A and no move is due: step now."""
    MOVING = "moving"
    """Samples were moved between shards: poll again once they arrived (at once in the simulator)."""
    WAITING = "waiting"
    """Some shard is short of samples: poll again after more arrived."""


class SampleMover(Protocol):
    """Carries samples a shard of this process gives to shard ``receiver`` (by index in the trainer group)."""

    def send(self, receiver: int, samples: list[Sample]) -> None: ...


class TrainerBackend(Protocol):
    """Trains the batches the role planned, one per shard it holds, at policy ``version``."""

    def train(self, plans: list[BatchPlan], version: int) -> dict: ...


class WeightPublisher(Protocol):
    """Brings policy ``version`` to the rollout engines (a weight sync: the command, then the weights)."""

    def publish(self, version: int) -> None: ...


class ProgressBoard(Protocol):
    """Where the trainer's progress goes to the rollout workers: the ``Leader`` (trainer rank 0's second role)."""

    def publish(self, steps_done: int, view: TrainerView) -> None: ...


@dataclass
class StepDone:
    plans: list[BatchPlan]
    """Each shard's batch, in the order of ``TrainerRole.shards``."""
    stats: dict
    """What the backend returned."""
    trained_version: int
    version: int
    """The policy version after the step (trained_version + 1)."""
    synced: bool
    """Whether the step ended at a sync point and published the weights."""

    @property
    def fresh(self) -> list[Sample]:
        return [s for plan in self.plans for s in plan.fresh]

    @property
    def trained(self) -> list[Sample]:
        return [s for plan in self.plans for s in plan.fresh + plan.replayed]


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


class TrainerRole:
    def __init__(
        self, shards: Sequence[TrainerShard], sync_interval: int, exchange: ReadinessExchange, mover: SampleMover,
        backend: TrainerBackend, publisher: WeightPublisher, board: ProgressBoard | None = None,
        first_use: Callable[[list[Sample]], None] | None = None,
    ):
        """``board``: the leader, on the process that holds it (None elsewhere). ``first_use``: the advantage
        estimator's batch stage, applied to the step's fresh samples before training (a replayed sample keeps
        the advantage it was first trained with)."""
        self.shards = list(shards)
        self.sync_interval = sync_interval
        self.exchange = exchange
        self.mover = mover
        self.backend = backend
        self.publisher = publisher
        self.board = board
        self.first_use = first_use
        self._evicted_at: int | None = None
        """The version the shards last evicted aged samples at (a sample ages only when the version moves; one
        that arrives stale is retired on arrival)."""
        self._reports: list[tuple[tuple[int, int], ShardReadiness] | None] = [None] * len(self.shards)
        """Each shard's latest readiness, keyed by (its revision, the version): computed again only when the
        shard changed or the version moved."""

    # ---- the wait loop ----------------------------------------------------------------

    def readiness(self, version: int) -> list[ShardReadiness]:
        out = []
        for index, shard in enumerate(self.shards):
            key = (shard.revision, version)
            cached = self._reports[index]
            if cached is None or cached[0] != key:
                cached = self._reports[index] = (key, shard.readiness(version))
            out.append(cached[1])
        return out

    def view(self, version: int, steps_done: int) -> TrainerView:
        """The readiness exchange over every shard; the leader, where this process holds it, publishes Progress."""
        view = self.exchange.exchange(self.readiness(version))
        if self.board is not None:
            self.board.publish(steps_done, view)
        return view

    def poll(self, version: int, steps_done: int) -> Poll:
        """One pass of the wait loop (R3, R4); every process of the trainer group calls it at the same point."""
        if self._evicted_at != version:
            for shard in self.shards:
                shard.evict_stale(version, "aged")
            self._evicted_at = version
        view = self.view(version, steps_done)
        moves = view.moves(self.shards[0].batch_per_shard)
        if not moves:
            return Poll.READY if view.all_ready else Poll.WAITING
        for shard in self.shards:
            for receiver, samples in shard.donate(moves, version):
                self.mover.send(receiver, samples)
        return Poll.MOVING

    # ---- the step ---------------------------------------------------------------------

    def step(self, version: int, step: int, phase: Callable[[str], ContextManager] = _no_phase) -> StepDone:
        """1. plan every shard's batch of exactly b/A; 2. the first-use advantages; 3. train; 4. retire the first
        uses (the replay filter takes what was consumed); 5. at a sync point, evict what the new version ages out
        and publish the weights; 6. exchange, so the rollout workers learn the retirements. ``phase(name)``
        brackets the "train" and "sync" phases (the live run's timer)."""
        plans = [shard.plan(version) for shard in self.shards]
        for shard, plan in zip(self.shards, plans):
            shard.ledger["consumed"].extend(
                {
                    "uid": s.uid, "step": step, "staleness": shard.buffer.staleness(s, version),
                    "head_lag": s.head_lag(version), "response_len": len(s.output_ids),
                }
                for s in plan.fresh
            )
        if self.first_use is not None:
            self.first_use([s for plan in plans for s in plan.fresh])
        with phase("train"):
            stats = self.backend.train(plans, version)
        for shard, plan in zip(self.shards, plans):
            shard.retire_trained(plan)
        new_version = version + 1
        synced = new_version % self.sync_interval == 0
        if synced:  # (a step that does not sync spends no time in this phase)
            with phase("sync"):
                for shard in self.shards:
                    shard.evict_stale(new_version, "at_sync")
                self.publisher.publish(new_version)
        self.view(new_version, step)
        return StepDone(plans, stats, version, new_version, synced)
