"""The live implementations of the protocols the shared roles run over (``reflow.modes.trainer_role``,
``reflow.modes.transition``): what ``DecoupledMode`` plugs in where the simulator plugs in its cost model and
in-process queues.

  PolicyTrainerBackend  TrainerBackend   this rank's batch through ``PolicyTrainer.train_step``
  LiveWeightPublisher   WeightPublisher  SyncWeights to the rollout workers, then the weight broadcast
  OutboxMover           SampleMover      samples for another shard, on the data plane
  LivePlacementLinks    PlacementLinks   FLUSH and handovers on the data plane; the clock and the held
                                         groups by gloo collectives
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from reflow.dataplane import Outbox
from reflow.modes.commands import SyncWeights
from reflow.modes.leader import Leader
from reflow.replay.buffer import BatchPlan
from reflow.trainer.batch import mask_stale_tokens, to_batch
from reflow.types import Flush, Handover, Moved, Sample


class PolicyTrainerBackend:
    """The live ``TrainerBackend``: this rank's batch (replayed rows at loss weight tau, model tokens older than
    max_head_lag versions masked out of the loss) through ``PolicyTrainer.train_step``."""

    def __init__(self, trainer, pad_id: int, tau: float, max_head_lag: int | None, mask_truncated: bool):
        self.trainer, self.pad_id, self.tau = trainer, pad_id, tau
        self.max_head_lag, self.mask_truncated = max_head_lag, mask_truncated

    def train(self, plans: list[BatchPlan], version: int) -> dict:
        (plan,) = plans  # a rank holds one shard
        weights = [1.0] * len(plan.fresh) + [self.tau] * len(plan.replayed)
        batch = to_batch(plan.fresh + plan.replayed, self.pad_id, weights, self.mask_truncated)
        model_tokens = batch.num_tokens()
        masked = mask_stale_tokens(batch, version - self.max_head_lag) if self.max_head_lag is not None else 0
        start = time.time()
        stats = self.trainer.train_step(batch)
        return {
            "stats": stats, "model_tokens": model_tokens, "masked": masked,
            "loss_tokens": batch.loss_weighted_tokens(), "train_start": start, "train_end": time.time(),
        }


class LiveWeightPublisher:
    """The live ``WeightPublisher``: the leader sends SyncWeights to the rollout workers (and, at an evaluation
    interval, expects their scores of the new version); then every trainer rank joins the broadcast."""

    def __init__(
        self, weight_sync, trainer, engine, leader: Leader | None, control, rollout_workers: list[int], eval_interval: int,
    ):
        self.weight_sync, self.trainer, self.engine = weight_sync, trainer, engine
        self.leader, self.control, self.rollout_workers, self.eval_interval = leader, control, rollout_workers, eval_interval

    def publish(self, version: int) -> None:
        if self.leader is not None:
            self.control.broadcast(SyncWeights(version), self.rollout_workers)
            if self.eval_interval and version % self.eval_interval == 0:  # the rollout workers evaluate this version
                self.leader.evaluations.expect(version, len(self.rollout_workers))
        self.weight_sync.sync(self.trainer, self.engine, version)


class OutboxMover:
    """The live ``SampleMover``: samples for another shard go to its rank on the data plane (``Moved``)."""

    def __init__(self, outbox: Outbox, trainer_ranks: list[int]):
        self.outbox, self.trainer_ranks = outbox, trainer_ranks

    def send(self, receiver: int, samples: list[Sample]) -> None:
        self.outbox.put(self.trainer_ranks[receiver], Moved(samples))


class LivePlacementLinks:
    """The live ``PlacementLinks``: FLUSH and handovers on the data plane, the clock and the held groups by gloo
    collectives over the world."""

    def __init__(self, outbox: Outbox, receive, flushed: set[int], settle_moves, world_size: int):
        self.outbox, self.receive, self.flushed, self.settle_moves = outbox, receive, flushed, settle_moves
        self.world_size = world_size

    def flush(self, trainer_ranks: list[int]) -> None:
        for rank in trainer_ranks:
            self.outbox.put(rank, Flush())

    def drain(self, rollout_workers: list[int]) -> None:
        while not set(rollout_workers) <= self.flushed:
            self.receive()
            time.sleep(0.002)
        self.flushed.clear()
        self.settle_moves()

    def hand_over(self, heir_rank: int, handover: Handover) -> None:
        self.outbox.put(heir_rank, handover)

    def broadcast(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.long)
        dist.broadcast(tensor, src=0)
        return [int(x) for x in tensor.tolist()]

    def all_gather(self, value) -> list:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered
