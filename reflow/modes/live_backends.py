"""The live side of the shared roles: the protocols ``reflow.modes.trainer_role`` and ``reflow.modes.transition``
run over, as ``DecoupledMode`` plugs them in where the simulator plugs in its cost model and in-process
queues, and the factories that wire a rank's roles from the built components.

  PolicyTrainerBackend  TrainerBackend   this rank's batch through ``PolicyTrainer.train_step``
  LiveWeightPublisher   WeightPublisher  SyncWeights to the rollout workers, then the weight broadcast
  OutboxMover           SampleMover      samples for another shard, on the data plane
  LivePlacementLinks    PlacementLinks   FLUSH and handovers on the data plane; the clock and the held
                                         groups by gloo collectives
  live_shard, live_trainer_role, live_rollout_worker
                                         a rank's roles in a placement
  agree_on_placement, transition_event   the placement decision and a change's cost, over the ranks
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from reflow.algorithms.settings import advantage_estimator
from reflow.config.mode_settings import ModeSettings
from reflow.dataplane import Outbox
from reflow.dataplane.collectives import GlooReadinessExchange
from reflow.distributed.placement import Placement
from reflow.modes.data_router import DataRouter
from reflow.modes.leader import Leader
from reflow.modes.rollout_worker import RolloutWorker
from reflow.modes.trainer_role import TrainerRole
from reflow.modes.trainer_shard import TrainerShard, new_shard
from reflow.modes.transition import ChangePlan
from reflow.replay import build_filter, build_sampler
from reflow.replay.buffer import BatchPlan
from reflow.rollout.admission import AdmissionGate
from reflow.rollout.groups import PromptGroups, evaluate_share
from reflow.rollout.scoring import TaskScorer
from reflow.scheduler import DispatchBudget
from reflow.serving.drivers import new_driver
from reflow.trainer.batch import mask_stale_tokens, to_batch
from reflow.types import Flush, Handover, Moved, Sample, SyncWeights

if TYPE_CHECKING:
    from reflow.modes.base import Components


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

    def __init__(self, outbox: Outbox, router: DataRouter, version: int, world_size: int):
        self.outbox, self.router, self.version, self.world_size = outbox, router, version, world_size

    def flush(self, trainer_ranks: list[int]) -> None:
        for rank in trainer_ranks:
            self.outbox.put(rank, Flush())

    def drain(self, rollout_workers: list[int]) -> None:
        self.router.drain_flushes(rollout_workers, self.version)

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


# ---- a rank's roles in a placement ------------------------------------------------------------------


def live_shard(
    parts: "Components", settings: ModeSettings, placement: Placement, ledger: dict, start_version: int,
) -> TrainerShard:
    """This trainer rank's shard, empty, under the [replay] section's sampler and filter."""
    cfg = parts.cfg
    return new_shard(
        settings, placement.trainer_ranks.index(parts.rank), len(placement.rollout_workers), batch_per_shard(cfg, placement),
        ledger, sampler=build_sampler(cfg.replay.sampler),
        replay_filter=build_filter(cfg.replay.filter, cfg.replay.filter_reward_low, cfg.replay.filter_reward_high),
        seed=cfg.job.seed + parts.rank, start_version=start_version, dynamic_sampling=cfg.reward.dynamic_sampling,
    )


def batch_per_shard(cfg, placement: Placement) -> int:
    """b/A: each trainer shard's share of a step's batch."""
    return cfg.training.prompts_per_step * cfg.training.group_size // placement.num_trainer_ranks


def live_trainer_role(
    parts: "Components", settings: ModeSettings, placement: Placement, shard: TrainerShard, weight_sync,
    leader: Leader | None, control, outbox: Outbox, first_use,
) -> TrainerRole:
    """The trainer role over this rank's one shard: readiness by gloo over the placement's trainer group, moves
    on the data plane, ``PolicyTrainer`` for the step, the placement's weight sync for publishing."""
    cfg = parts.cfg
    num_trainer, num_rollout = placement.num_trainer_ranks, len(placement.rollout_workers)
    group = parts.layouts[placement.replicate_degree].group
    return TrainerRole(
        [shard], settings.interval, GlooReadinessExchange(group, shard.index, num_trainer, num_rollout),
        OutboxMover(outbox, placement.trainer_ranks),
        PolicyTrainerBackend(parts.trainer, parts.tokenizer.pad_id, settings.tau, settings.max_head_lag,
                             cfg.loss.mask_truncated),
        LiveWeightPublisher(weight_sync, parts.trainer, parts.engine, leader, control, placement.rollout_workers,
                            cfg.metrics.eval_interval),
        board=leader, first_use=first_use,
    )


def live_rollout_worker(
    parts: "Components", settings: ModeSettings, placement: Placement, stream, share, weight_sync, control,
    outbox: Outbox, *, step: int, carried: list, evaluate_first: bool,
) -> RolloutWorker:
    """This rank's rollout worker in ``placement``: its prompt ``share`` of the run's ``stream``, a dispatch
    budget from ``step`` on (dealt by the leader under scheduler.kv_admission), the admission gate, and an
    evaluation of its share of the held-out prompts at the weight syncs metrics.eval_interval asks for."""
    cfg, training = parts.cfg, parts.cfg.training
    index, num_rollout = placement.rollout_workers.index(parts.rank), len(placement.rollout_workers)
    budget = DispatchBudget(
        settings.dispatch, index, num_rollout, training.group_size, start_step=step, dealt=cfg.scheduler.kv_admission,
    )
    # evaluation runs on a driver of its own: trajectories of the run waiting on a tool stay in ``parts.turns``
    eval_turns = new_driver(parts.engine, parts.task, parts.tokenizer, cfg.task.tool_workers, agents=parts.agents)

    def evaluate(version: int) -> tuple[float, int]:
        return evaluate_share(parts, eval_turns, cfg.metrics.eval_num_prompts, index, num_rollout)

    return RolloutWorker(
        parts.engine, parts.turns,
        PromptGroups(stream, share, parts.task, parts.tokenizer, training.group_size, cfg.rollout.max_new_tokens,
                     cfg.job.seed),
        TaskScorer(parts.task, parts.tokenizer, advantage_estimator(cfg), parts.rewards),
        weight_sync, control, outbox, budget,
        AdmissionGate(cfg.scheduler, cfg.rollout, parts.engine, training.group_size, parts.turns, clock=time.time),
        index, placement.trainer_ranks, evaluate=evaluate, eval_interval=cfg.metrics.eval_interval,
        evaluate_first=evaluate_first, carried=carried, first_tokens_before_sync=settings.first_tokens_before_sync,
        timeline=parts.timeline,
    )


# ---- the placement, over the ranks ------------------------------------------------------------------


def agree_on_placement(leader: Leader | None, step: int, replicas: int, group, logger) -> int | None:
    """At a sync point: the leader asks its controller (and logs a decision worth logging); every trainer rank
    learns the answer by one broadcast over the trainer ``group``. Returns the target replica count, or None."""
    target = torch.zeros(1, dtype=torch.long)
    if leader is not None:
        decision = leader.decide_placement(step, replicas)
        target[0] = decision.target or 0
        if leader.logs_decision(decision):
            logger.log(step, decision.as_row())
            logger.info(f"placement decision after step {step}: {decision.reason}")
    dist.broadcast(target, src=0, group=group)
    return int(target.item()) or None


def transition_event(plan: ChangePlan, resized, seconds: float, rank: int, step: int) -> dict:
    """A placement change's row, over every rank: the slowest rank's seconds and the bytes all of them moved."""
    slowest = torch.tensor([seconds], dtype=torch.float64)
    moved = torch.tensor([resized.bytes_moved], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(moved)
    return {
        "transition": f"{plan.old.name} -> {plan.new.name}", "direction": resized.direction if rank == 0 else "",
        "placement": plan.new.name, "transition_s": slowest.item(), "bytes_moved": int(moved.item()),
        "after_step": step,
    }
