"""Decoupled modes (one_step_off, async, reflow): trainer ranks train from their replay-buffer shard while
rollout workers stream samples. The protocol, the replay cycle's rule and why neither wastes samples nor
deadlocks: ``docs/decoupled_protocol.md``. The roles:

  ``TrainerShard``     (``trainer_shard``)   one shard's buffer and counts: receive, evict, retire,
                                             readiness, moves, the batch
  ``TrainerRole``      (``trainer_role``)    the trainer's side over its shards: one pass of the wait
                                             loop (poll), one step (plan, train, retire, sync, progress)
  ``Leader``           (``leader``)          trainer rank 0's second role: progress, dispatch, reports,
                                             evaluations, placement decisions
  ``RolloutWorker``    (``rollout_worker``)  one engine's loop: commands, admission, generation, routing
  ``change_placement`` (``transition``)      a placement change on every rank
  ``DataRouter``       (``data_router``)     this rank's data-plane messages, to the roles it holds
  ``resume``                                 what a checkpoint saves of the replay state, and its restore
  ``ledger``                                 where every sample went, per rank
  ``live_backends``                          the roles' live protocols, and the factories that wire them

This module is the live wiring only: which roles this rank holds in the current placement, the order in
which a rank plays them over the run (``run``), and each step's row.
"""

from __future__ import annotations

import time

from reflow.config.mode_settings import resolve_settings
from reflow.dataplane import open_planes
from reflow.distributed.placement import Placement
from reflow.modes.base import Components, ModeBase, StepTimer
from reflow.modes.data_router import POLL_S, DataRouter
from reflow.modes.leader import Leader
from reflow.modes.ledger import merge_rollout_ledger, new_ledger, write_ledger
from reflow.modes.live_backends import (
    LivePlacementLinks,
    agree_on_placement,
    batch_per_shard,
    live_rollout_worker,
    live_shard,
    live_trainer_role,
    transition_event,
)
from reflow.modes.prompts import initial_shares, reassign
from reflow.modes.replay_metrics import replay_cycle_metrics
from reflow.modes.resume import replay_checkpoint, restore_replay_state
from reflow.modes.trainer_role import Poll
from reflow.modes.trainer_shard import TrainerShard
from reflow.modes.transition import ChangePlan, RankState, TrainerClock, change_placement, take_up_shard
from reflow.rollout.tensor_parallel import engine_mirror, follow
from reflow.scheduler import build_controller
from reflow.types import HeldGroup, Stop, Transition


class DecoupledMode(ModeBase):
    def __init__(self, parts: Components):
        super().__init__(parts)
        cfg = parts.cfg
        self.name = cfg.training.mode
        self.settings = resolve_settings(cfg)
        self.max_staleness = self.settings.delta
        self.staleness_anchor = self.settings.anchor
        self.evaluates_in_loop = False  # the rollout workers evaluate at weight syncs (``RolloutWorker._evaluate``)
        self.rank = parts.rank
        self.planes = open_planes(parts.rank, parts.world_size)  # (collective: every rank, at the same point)
        self.steps_done = 0
        self.ledger = new_ledger()
        self.shard: TrainerShard | None = None
        controller = build_controller(
            parts.schedule, cfg.scheduler, parts.world_size, parts.placement.shard_degree, tuple(parts.layouts),
            self.settings.sigma, cfg.training.prompts_per_step * cfg.training.group_size,
        )
        self.places = controller is not None
        """Whether a placement controller runs (every trainer rank joins its decision's broadcast)."""
        self.leader = Leader(self.planes.control, cfg.training.group_size, controller) if parts.rank == 0 else None
        self.router = DataRouter(self.planes.inbox, parts.rank, self.leader)
        self.shares: list | None = None  # the rollout workers' prompt shares, made once the resume point is known
        # the prompt stream's position for checkpoints (``reflow.modes.resume``)
        self.prompt_frontier = 0
        self.prompt_holes: list[int] = []
        self.change_to: int | None = None
        self.carried: list[HeldGroup] = []  # partial rollouts across a placement change: held, then to resume
        self.mirror = engine_mirror(parts.placement.world_size, parts.placement.rollout_tp, parts.rank)
        self.enter(parts.placement)
        if self.is_trainer and not parts.placement.is_rollout(parts.rank):
            parts.engine.sleep()  # frees accelerator memory while this rank trains

    # ================================================================ roles of the current placement

    def enter(self, placement: Placement) -> None:
        """Take up this rank's roles in ``placement`` (at startup and after a transition). Every dispatch budget
        starts at the current step; a shard kept from the previous placement counts its samples against none."""
        parts, cfg = self.parts, self.parts.cfg
        self.placement = placement
        self.trainer_ranks = placement.trainer_ranks
        self.rollout_workers = placement.rollout_workers  # one per engine: every rollout rank, or each TP block's first
        self.is_trainer = placement.is_trainer(self.rank)
        # a rank of a tensor-parallel engine that generates but does not lead it replays its leader's calls
        self.is_follower = not self.is_trainer and self.rank not in self.rollout_workers
        parts.engine.mirror = self.mirror if self.mirror is not None and self.rank in self.rollout_workers else None
        if self.leader is not None:
            self.leader.enter(self.rollout_workers, self._new_dispatcher())
        if self.is_trainer:
            self.shard = take_up_shard(
                self.shard, placement, self.rank, batch_per_shard(cfg, placement),
                lambda: live_shard(parts, self.settings, placement, self.ledger, self.version),
            )
            self.role = live_trainer_role(parts, self.settings, placement, self.shard, self.weight_sync, self.leader,
                                          self.planes.control, self.planes.outbox, self.first_use_advantages)
        self.router.shard = self.shard
        if self.shares is not None:
            self.shares = reassign(self.shares, len(self.rollout_workers))

    def _new_dispatcher(self):
        cfg = self.parts.cfg
        return Leader.new_dispatcher(self.settings.dispatch, len(self.rollout_workers), cfg.training.group_size,
                                     cfg.scheduler.rho, self.step, dealt=cfg.scheduler.kv_admission)

    @property
    def trainer_group(self):
        return self.parts.layouts[self.placement.replicate_degree].group

    @property
    def weight_sync(self):
        return self.parts.weight_syncs[self.placement.replicate_degree]

    # ================================================================ trainer side

    def train_one_step(self, step: int) -> dict:
        timer = StepTimer(self.parts.timeline)
        # 1. wait (idle) until every shard can serve a batch of exactly b/A and no move between shards is pending
        #    or due; all trainer ranks leave together (R3, R4)
        with timer("wait"):
            while True:
                self.router.receive(self.version)
                if self.role.poll(self.version, self.steps_done) is Poll.READY:
                    break
                time.sleep(POLL_S)
        # 2-6. the trainer role's step: plan, first-use advantages, train, retire, sync at sync points, progress
        done = self.role.step(self.version, step, phase=timer)
        trained = done.stats
        self.ledger["steps"].append(
            {"step": step, "version": done.trained_version, "train_start": trained["train_start"],
             "train_end": trained["train_end"]}
        )
        self._drawn = max([self._drawn] + [s.draw + 1 for s in done.fresh])
        self.version, self.steps_done = done.version, step
        # 7. the row, over the trainer ranks: the trainer's figures, the replay cycle's, and the leader's
        row = self.step_metrics(
            done.fresh, done.trained, trained["stats"], timer, done.trained_version, trainer_wait_s=timer.get("wait"),
            loss_tokens=trained["loss_tokens"],
        )
        row.update(replay_cycle_metrics(self.shard, done.plans[0], done.trained_version, trained["model_tokens"],
                                        trained["masked"], self.settings, self.trainer_group))
        row.update(trainer_wait_s=timer.get("wait"), placement=self.placement.name)
        if self.leader is not None:
            row.update(self.leader.step_row())
        return row

    @property
    def _evaluates_start(self) -> bool:
        """A new run (not a resumed one) evaluates its starting policy, version 0, before generating."""
        return bool(self.parts.cfg.metrics.eval_interval) and self.version == 0 and self.step == 0

    # ================================================================ the role loop

    def run(self) -> list[dict]:
        """Every rank: 1. resume (the trainer's state, then the replay state and the prompt stream's position);
        2. take up the saved placement if it differs; 3. loop: play this rank's role in the current placement
        until it ends (Stop, or a placement change at a sync point), change placement, repeat; 4. shut down."""
        # 1. resume
        self.resume()
        position = restore_replay_state(self.parts.checkpoints, self.shard, len(self.trainer_ranks), self.ledger,
                                        self.leader, self.parts.logger.info)
        if position is not None:
            self.prompt_frontier, self.prompt_holes = position.frontier, list(position.holes)
            self._drawn = position.frontier
        self.steps_done = self.step
        if self.leader is not None:
            self.leader.enter(self.rollout_workers, self._new_dispatcher())  # its budgets start at the resumed step
        self.shares = initial_shares(len(self.rollout_workers), self._drawn, self.prompt_holes)
        if self.is_trainer:
            self.shard.buffer.start_version = self.version  # the engines start (or resume) on this version
        if self.leader is not None and self._evaluates_start:
            self.leader.evaluations.expect(0, len(self.rollout_workers))
        # 2. the saved placement (nothing is in flight yet; every rank knows it)
        if self.resumed_replicas not in (None, self.placement.replicate_degree):
            if self.resumed_replicas in self.parts.layouts:
                self._transition(self.resumed_replicas)
            else:
                self.parts.logger.info(
                    f"the checkpoint was saved with {self.resumed_replicas} trainer replicas, not feasible on this "
                    f"world; continuing on {self.placement.name}"
                )
        # 3. the roles
        history = []
        while True:
            if self.is_trainer:
                self.change_to = None
                history += self.train_loop()
                # a run that stopped early may have decided a change: its checkpoint holds it for the resumed run
                target = None if self.finished else self.change_to
                if self.leader is not None:
                    self.planes.control.broadcast(Transition(target) if target else Stop(), self.rollout_workers)
            else:
                if self.is_follower:
                    command = follow(self.parts.engine, self.mirror, self.weight_sync)
                else:
                    worker = live_rollout_worker(
                        self.parts, self.settings, self.placement, self.stream,
                        self.shares[self.rollout_workers.index(self.rank)], self.weight_sync, self.planes.control,
                        self.planes.outbox, step=self.step, carried=self.carried, evaluate_first=self._evaluates_start,
                    )
                    command = worker.run()
                    self.carried = worker.carried_out
                    merge_rollout_ledger(self.ledger, worker.ledger)
                target = command.replicas if isinstance(command, Transition) else None
            if target is None:
                break
            self._transition(target)
        # 4. shut down: END to every other rank, drain until END from every other rank (rank 0 logs an evaluation
        #    of the final policy that finished meanwhile, in a row of its own), close the planes
        self.planes.outbox.close([r for r in range(self.parts.world_size) if r != self.rank])
        self.router.drain_to_end(self.version)
        final_eval = self.leader.evaluations.finished() if self.leader is not None else {}
        if final_eval:
            self.parts.logger.log(self.step, final_eval)
        if self.shard is not None:
            self.shard.leave_at_end()
        self.planes.control.close()
        write_ledger(self.ledger, self.parts.cfg.job.dump_folder, self.rank, self.is_trainer)
        return history

    def pause_requested(self, row: dict) -> bool:
        """At a sync point, the leader asks the placement controller; every trainer rank learns the answer."""
        if not self.places:
            return False
        if self.leader is not None:
            self.leader.placement_rows.append({**row, "step": self.step})
        if self.version % self.settings.interval:
            return False
        self.change_to = agree_on_placement(self.leader, self.step, self.placement.replicate_degree,
                                            self.trainer_group, self.parts.logger)
        return self.change_to is not None

    def _transition(self, replicas: int) -> None:
        """Every rank: ``change_placement``'s steps 1-4, then this rank's roles in the new placement and its weight
        sync (weights into every engine that generates now; one that was asleep wakes in load_weights)."""
        parts, t0 = self.parts, time.perf_counter()
        with parts.timeline.span("transition", replicas=replicas):
            plan = ChangePlan.to(self.placement, replicas)
            links = LivePlacementLinks(self.planes.outbox, self.router, self.version, parts.world_size)
            clock = TrainerClock(self.step, self.version, self.steps_done, self._drawn)
            before = RankState(clock, self.shard, self.shares, self.carried)
            after, resized = change_placement(plan, self.rank, before, links, parts.engine, parts.trainer,
                                              bucket_bytes=int(parts.cfg.weight_sync.bucket_size_mb * 2**20))
            self.step, self.version, self.steps_done, self._drawn = (
                after.clock.step, after.clock.version, after.clock.steps_done, after.clock.drawn,
            )
            self.shard, self.shares, self.carried = after.shard, after.shares, after.carried
            self.enter(plan.new)  # (the budgets start afresh: no sample a shard holds counts against the old ones)
            self.weight_sync.sync(parts.trainer if self.is_trainer else None, parts.engine, self.version)
            event = transition_event(plan, resized, time.perf_counter() - t0, self.rank, self.step)
        parts.timeline.role("trainer" if self.placement.is_trainer(self.rank) else "rollout")
        self.ledger["transitions"].append(event)
        if self.leader is not None:
            self.leader.placement_rows.append(event)  # the controller learns what the change cost
            parts.logger.log(self.step, {k: v for k, v in event.items() if k != "after_step"})
            parts.logger.info(f"placement {event['transition']} after step {self.step} in {event['transition_s']:.2f}s")

    # ================================================================ checkpoints (``reflow.modes.resume``)

    def checkpoint_state(self) -> tuple[dict, dict[str, object]]:
        """Beside the trainer's state: each shard's replay buffer, and on rank 0 the prompt stream's position and
        the placement controller's memory."""
        self.router.settle_moves(self.version)  # a sample moving between shards is in one of them when saved
        extra, files = super().checkpoint_state()
        extra["prompts_drawn"], replay_files = replay_checkpoint(
            self.shard, self.prompt_frontier, self.prompt_holes, regenerate=self.settings.min_staleness > 0,
            group=self.trainer_group, leader=self.leader,
        )
        files.update(replay_files)
        # the step's placement decision came first: a change it decided is the placement a resumed run takes up
        extra["trainer_replicas"] = self.change_to or self.placement.replicate_degree
        return extra, files
