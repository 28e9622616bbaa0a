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
  ``resume``                                 what a checkpoint saves of the replay state, and its restore
  ``ledger``                                 where every sample went, per rank

This module keeps the live wiring: which role each rank has in the current placement, the message routing
between the planes and the roles, the trainer role's live backends (``PolicyTrainer``, the weight sync, the
data plane for moves) and each step's metrics.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from reflow.algorithms.aggregation import replay_gradient_share
from reflow.algorithms.settings import advantage_estimator
from reflow.config.mode_settings import resolve_settings
from reflow.dataplane import ControlChannel, Inbox, Outbox
from reflow.dataplane.collectives import GlooReadinessExchange
from reflow.dataplane.transport import DATA
from reflow.distributed.placement import Placement
from reflow.modes.base import Components, ModeBase, StepTimer
from reflow.modes.commands import Stop, Transition
from reflow.modes.leader import Leader
from reflow.modes.ledger import merge_rollout_ledger, new_ledger, write_ledger
from reflow.modes.live_backends import LivePlacementLinks, LiveWeightPublisher, OutboxMover, PolicyTrainerBackend
from reflow.modes.prompts import initial_shares, reassign
from reflow.modes.replay_metrics import replay_cycle_metrics
from reflow.modes.resume import restore_shard, save_shard
from reflow.modes.rollout_worker import RolloutWorker
from reflow.modes.trainer_role import Poll, TrainerRole
from reflow.modes.trainer_shard import TrainerShard
from reflow.modes.transition import ChangePlan, RankState, TrainerClock, change_placement
from reflow.replay import ReplayBuffer, build_filter, build_sampler
from reflow.rollout.admission import AdmissionGate
from reflow.rollout.groups import PromptGroups, evaluate_share
from reflow.rollout.scoring import TaskScorer
from reflow.rollout.tensor_parallel import engine_mirror, follow
from reflow.rollout.turns import TurnDriver
from reflow.scheduler import DispatchBudget, ForcedSchedule, PlacementController, PlacementPlanner, PlannerSettings
from reflow.types import EvalShare, Flush, GroupDone, Handover, HeldGroup, Moved, WorkerStats


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
        # planes: created by every rank at the same point (new_group is collective). Any rank may train or
        # generate over the run, so every rank can send and receive data; commands go from rank 0 (which
        # trains in every placement) to any other rank.
        data_group = dist.new_group(backend="gloo")
        control_group = dist.new_group(backend="gloo")
        others = [r for r in range(parts.world_size) if r != parts.rank]
        everyone_but_leader = [r for r in range(parts.world_size) if r != 0]
        self.control = ControlChannel(control_group, parts.rank, 0, everyone_but_leader)
        self.inbox = Inbox(data_group, others, "data")
        self.outbox = Outbox(data_group, "data")
        self.steps_done = 0
        self.ledger = new_ledger()
        self.shard: TrainerShard | None = None
        controller = self._placement_controller()
        self.places = controller is not None
        """Whether a placement controller runs (every trainer rank joins its decision's broadcast)."""
        self.leader = Leader(self.control, cfg.training.group_size, controller) if parts.rank == 0 else None
        self.shares: list | None = None  # the rollout workers' prompt shares, made once the resume point is known
        # the prompt stream's position for checkpoints (``reflow.modes.resume``)
        self.prompt_frontier = 0
        self.prompt_holes: list[int] = []
        self.change_to: int | None = None
        self.flushed: set[int] = set()  # rollout workers whose FLUSH arrived (placement changes)
        self.carried: list[HeldGroup] = []  # partial rollouts across a placement change: held, then to resume
        self.mirror = engine_mirror(parts.placement.world_size, parts.placement.rollout_tp, parts.rank)
        self.enter(parts.placement)
        if self.is_trainer and not parts.placement.is_rollout(parts.rank):
            parts.engine.sleep()  # frees accelerator memory while this rank trains

    def _placement_controller(self) -> PlacementController | None:
        parts, cfg = self.parts, self.parts.cfg
        if parts.schedule:
            return ForcedSchedule(parts.schedule)
        if cfg.scheduler.adaptive_placement:
            return PlacementPlanner(PlannerSettings.from_section(
                cfg.scheduler, parts.world_size, parts.placement.shard_degree, tuple(sorted(parts.layouts)),
                self.settings.sigma, cfg.training.prompts_per_step * cfg.training.group_size,
            ))
        return None

    # ================================================================ roles of the current placement

    def enter(self, placement: Placement) -> None:
        """Take up this rank's roles in ``placement`` (at startup and after a transition). Every dispatch budget
        starts at the current step; a shard kept from the previous placement counts its samples against none."""
        cfg = self.parts.cfg
        self.placement = placement
        self.trainer_ranks = placement.trainer_ranks
        self.rollout_workers = placement.rollout_workers  # one per engine: every rollout rank, or each TP block's first
        self.is_trainer = placement.is_trainer(self.rank)
        # a rank of a tensor-parallel engine that generates but does not lead it replays its leader's calls
        self.is_follower = not self.is_trainer and self.rank not in self.rollout_workers
        self.parts.engine.mirror = self.mirror if self.mirror is not None and self.rank in self.rollout_workers else None
        self.batch_per_shard = cfg.training.prompts_per_step * cfg.training.group_size // len(self.trainer_ranks)
        if self.leader is not None:
            self.leader.enter(self.rollout_workers, self._new_dispatcher())
        if self.is_trainer:
            index, num_rollout = self.trainer_ranks.index(self.rank), len(self.rollout_workers)
            if self.shard is None:
                self.shard = TrainerShard(
                    self._new_buffer(), index, num_rollout, self.batch_per_shard, self.ledger,
                    dynamic_sampling=cfg.reward.dynamic_sampling,
                )
            else:
                self.shard.index, self.shard.batch_per_shard = index, self.batch_per_shard
                self.shard.restart_budgets(num_rollout)
            parts = self.parts
            self.role = TrainerRole(
                [self.shard], self.settings.interval,
                GlooReadinessExchange(self.trainer_group, index, len(self.trainer_ranks), num_rollout),
                OutboxMover(self.outbox, self.trainer_ranks),
                PolicyTrainerBackend(parts.trainer, parts.tokenizer.pad_id, self.settings.tau, self.settings.max_head_lag,
                                     cfg.loss.mask_truncated),
                LiveWeightPublisher(self.weight_sync, parts.trainer, parts.engine, self.leader, self.control,
                                    self.rollout_workers, cfg.metrics.eval_interval),
                board=self.leader, first_use=self.first_use_advantages,
            )
        if self.shares is not None:
            self.shares = reassign(self.shares, len(self.rollout_workers))

    def _new_buffer(self) -> ReplayBuffer:
        cfg = self.parts.cfg
        buffer = ReplayBuffer(
            self.settings.sigma, self.settings.delta, build_sampler(cfg.replay.sampler),
            build_filter(cfg.replay.filter, cfg.replay.filter_reward_low, cfg.replay.filter_reward_high),
            seed=cfg.job.seed + self.rank, min_staleness=self.settings.min_staleness, anchor=self.settings.anchor,
        )
        buffer.start_version = self.version
        return buffer

    def _new_dispatcher(self):
        """The leader's dealer of this placement's dispatch room (scheduler.kv_admission, which only async and
        reflow accept), starting at the current step; None when every rollout worker owns a fixed share."""
        cfg = self.parts.cfg
        if not self.dealt_dispatch:
            return None
        return Leader.new_dispatcher(self.settings.dispatch, len(self.rollout_workers), cfg.training.group_size,
                                     cfg.scheduler.rho, self.step)

    @property
    def dealt_dispatch(self) -> bool:
        return self.parts.cfg.scheduler.kv_admission

    @property
    def trainer_group(self):
        return self.parts.layouts[self.placement.replicate_degree].group

    @property
    def weight_sync(self):
        return self.parts.weight_syncs[self.placement.replicate_degree]

    # ================================================================ the data plane, to the roles

    def receive(self) -> None:
        """Hand every data-plane message that arrived to the role it is for."""
        for message in self.inbox.drain():
            if message.kind != DATA:
                continue
            body = message.body
            if isinstance(body, (GroupDone, Moved, Handover)) and self.shard is None:
                raise RuntimeError(f"rank {self.rank} generates but received samples from rank {message.src}")
            if isinstance(body, GroupDone):
                self.shard.accept_group(body.samples, self.version)
            elif isinstance(body, Moved):
                self.shard.accept_moved(body.samples)
            elif isinstance(body, Handover):
                self.shard.accept_handover(body.samples, body.draws)
            elif isinstance(body, WorkerStats):
                self.leader.receive_stats(message.src, body)
            elif isinstance(body, EvalShare):
                self.leader.evaluations.add(body)
            elif isinstance(body, Flush):
                self.flushed.add(message.src)
            else:
                raise TypeError(f"rank {self.rank}: unknown data-plane message {body!r} from rank {message.src}")

    def settle_moves(self) -> None:
        """Receive until every sample other shards are moving to this one has arrived."""
        while self.shard.awaiting_moved:
            self.receive()
            time.sleep(0.002)

    # ================================================================ trainer side

    def _wait_for_batch(self) -> None:
        """Block (idle) until every trainer shard can serve a batch of exactly b/A and no move between shards is
        pending or due; all trainer ranks leave together (R3, R4)."""
        while True:
            self.receive()
            if self.role.poll(self.version, self.steps_done) is Poll.READY:
                return
            time.sleep(0.002)

    def train_one_step(self, step: int) -> dict:
        timer = StepTimer(self.parts.timeline)
        # 1. wait until every shard can serve a batch of exactly b/A (fresh samples within the staleness bound)
        with timer("wait"):
            self._wait_for_batch()
        # 2-6. the trainer role's step: plan, first-use advantages, train, retire, sync at sync points, progress
        done = self.role.step(self.version, step, phase=timer)
        trained = done.stats
        self.ledger["steps"].append(
            {"step": step, "version": done.trained_version, "train_start": trained["train_start"],
             "train_end": trained["train_end"]}
        )
        self._drawn = max([self._drawn] + [s.draw + 1 for s in done.fresh])
        self.version, self.steps_done = done.version, step
        # 7. metrics over the trainer ranks
        row = self.step_metrics(
            done.fresh, done.trained, trained["stats"], timer, done.trained_version, trainer_wait_s=timer.get("wait"),
            loss_tokens=trained["loss_tokens"],
        )
        lag_buckets = max(self.max_staleness, self.settings.max_head_lag or 0) + 2
        row.update(replay_cycle_metrics(self.shard, done.plans[0], done.trained_version, trained["model_tokens"],
                                        trained["masked"], lag_buckets, self.trainer_group))
        row.update(
            trainer_wait_s=timer.get("wait"),
            alpha=replay_gradient_share(row["replay_fraction"], self.settings.tau),
            placement=self.placement.name,
        )
        if self.leader is not None:
            row.update(self.leader.rollout_window.close())
            dealt = self.leader.take_dealt()
            if dealt is not None:
                row["dispatched_groups"] = dealt
            row.update(self.leader.evaluations.finished())
        return row

    # ================================================================ rollout side

    def _rollout_worker(self) -> RolloutWorker:
        parts = self.parts
        index = self.rollout_workers.index(self.rank)
        budget = DispatchBudget(
            self.settings.dispatch, index, len(self.rollout_workers), parts.cfg.training.group_size,
            start_step=self.step, dealt=self.dealt_dispatch,
        )
        cfg, training = parts.cfg, parts.cfg.training
        num_rollout = len(self.rollout_workers)
        # evaluation runs on a driver of its own: trajectories of the run waiting on a tool stay in ``parts.turns``
        eval_turns = TurnDriver(parts.engine, parts.task, parts.tokenizer, cfg.task.tool_workers)

        def evaluate(version: int) -> tuple[float, int]:
            return evaluate_share(parts, eval_turns, cfg.metrics.eval_num_prompts, index, num_rollout)

        return RolloutWorker(
            parts.engine, parts.turns,
            PromptGroups(self.stream, self.shares[index], parts.task, parts.tokenizer, training.group_size,
                         cfg.rollout.max_new_tokens, cfg.job.seed),
            TaskScorer(parts.task, parts.tokenizer, advantage_estimator(cfg), parts.rewards),
            self.weight_sync, self.control, self.outbox, budget,
            AdmissionGate(cfg.scheduler, cfg.rollout, parts.engine, training.group_size, parts.turns, clock=time.time),
            index, self.trainer_ranks, evaluate=evaluate, eval_interval=cfg.metrics.eval_interval,
            evaluate_first=self._evaluates_start, carried=self.carried,
            first_tokens_before_sync=self.settings.first_tokens_before_sync, timeline=parts.timeline,
        )

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
        self._restore()
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
                    self.control.broadcast(Transition(target) if target else Stop(), self.rollout_workers)
            else:
                if self.is_follower:
                    command = follow(self.parts.engine, self.mirror, self.weight_sync)
                else:
                    worker = self._rollout_worker()
                    command = worker.run()
                    self.carried = worker.carried_out
                    merge_rollout_ledger(self.ledger, worker.ledger)
                target = command.replicas if isinstance(command, Transition) else None
            if target is None:
                break
            self._transition(target)
        # 4. shut down
        self._shut_down()
        return history

    def pause_requested(self, row: dict) -> bool:
        """At a sync point, the leader asks the placement controller; every trainer rank learns the answer."""
        if not self.places:
            return False
        if self.leader is not None:
            self.leader.placement_rows.append({**row, "step": self.step})
        if self.version % self.settings.interval:
            return False
        target = torch.zeros(1, dtype=torch.long)
        if self.leader is not None:
            decision = self.leader.decide_placement(self.step, self.placement.replicate_degree)
            target[0] = decision.target or 0
            if self.leader.logs_decision(decision):
                self.parts.logger.log(self.step, decision.as_row())
                self.parts.logger.info(f"placement decision after step {self.step}: {decision.reason}")
        dist.broadcast(target, src=0, group=self.trainer_group)
        self.change_to = int(target.item()) or None
        return self.change_to is not None

    def _transition(self, replicas: int) -> None:
        with self.parts.timeline.span("transition", replicas=replicas):
            event = self._change_placement(replicas)
        self.parts.timeline.role("trainer" if self.placement.is_trainer(self.parts.rank) else "rollout")
        self.ledger["transitions"].append(event)
        if self.leader is not None:
            self.leader.placement_rows.append(event)  # the controller learns what the change cost
            self.parts.logger.log(self.step, {k: v for k, v in event.items() if k != "after_step"})
            self.parts.logger.info(f"placement {event['transition']} after step {self.step} in {event['transition_s']:.2f}s")

    def _change_placement(self, replicas: int) -> dict:
        """Every rank: ``change_placement``'s steps 1-4, then this rank's roles in the new placement and its weight
        sync (weights into every engine that generates now; one that was asleep wakes in load_weights); returns
        the change's event row."""
        parts, t0 = self.parts, time.perf_counter()
        plan = ChangePlan.to(self.placement, replicas)
        links = LivePlacementLinks(self.outbox, self.receive, self.flushed, self.settle_moves, parts.world_size)
        clock = TrainerClock(self.step, self.version, self.steps_done, self._drawn)
        before = RankState(clock, self.shard, self.shares, self.carried)
        after, resized = change_placement(plan, self.rank, before, links, parts.engine, parts.trainer,
                                          bucket_bytes=int(parts.cfg.weight_sync.bucket_size_mb * 2**20))
        self.step, self.version, self.steps_done, self._drawn = (
            after.clock.step, after.clock.version, after.clock.steps_done, after.clock.drawn,
        )
        self.shard, self.shares, self.carried = after.shard, after.shares, after.carried
        self.enter(plan.new)  # (the budgets start afresh: no sample a shard holds counts against one of the old placement's)
        self.weight_sync.sync(parts.trainer if self.is_trainer else None, parts.engine, self.version)
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        moved = torch.tensor([resized.bytes_moved], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.all_reduce(moved)
        return {
            "transition": f"{plan.old.name} -> {plan.new.name}", "direction": resized.direction if self.rank == 0 else "",
            "placement": plan.new.name, "transition_s": seconds.item(), "bytes_moved": int(moved.item()),
            "after_step": self.step,
        }

    def _shut_down(self) -> None:
        """END to every other rank on the data plane; drain until END from every other rank (rank 0 logs an
        evaluation of the final policy that finished meanwhile); close the planes."""
        self.outbox.close([r for r in range(self.parts.world_size) if r != self.rank])
        while not self.inbox.done:
            self.receive()
            time.sleep(0.005)
        self.receive()
        self.inbox.join()
        final_eval = self.leader.evaluations.finished() if self.leader is not None else {}
        if final_eval:  # the last weight sync's evaluation arrived after the last step's row: a row of its own
            self.parts.logger.log(self.step, final_eval)
        if self.shard is not None:
            self.shard.leave_at_end()
        self.control.close()
        write_ledger(self.ledger, self.parts.cfg.job.dump_folder, self.rank, self.is_trainer)

    # ================================================================ checkpoints (``reflow.modes.resume``)

    def checkpoint_state(self) -> tuple[dict, dict[str, object]]:
        """Beside the trainer's state: each shard's replay buffer, and on rank 0 the prompt stream's position and
        the placement controller's memory. One all-gather of the draws delivered over the trainer group."""
        self.settle_moves()  # a sample moving between shards is in one of them when saved
        extra, files = super().checkpoint_state()
        position, saved = save_shard(self.shard, self.prompt_frontier, self.prompt_holes,
                                     regenerate=self.settings.min_staleness > 0, group=self.trainer_group)
        extra["prompts_drawn"] = position.frontier
        # the step's placement decision came first: a change it decided is the placement a resumed run takes up
        extra["trainer_replicas"] = self.change_to or self.placement.replicate_degree
        files[f"replay-shard{self.shard.index}"] = saved
        if self.rank == 0:
            files["prompt-stream"] = {"frontier": position.frontier, "holes": list(position.holes)}
            controller = self.leader.controller_state()
            if controller is not None:
                files["placement-controller"] = controller
        return extra, files

    def _restore(self) -> None:
        """After ``resume``: the prompt stream's position, each trainer shard's share of the saved buffers, and on
        rank 0 the placement controller's memory."""
        checkpoints = self.parts.checkpoints
        stream = checkpoints.read_files("prompt-stream").get("prompt-stream")
        if stream is None:  # a checkpoint without it (sync mode's): the furthest prompt drawn
            return
        controller = checkpoints.read_files("placement-controller").get("placement-controller")
        if self.leader is not None and controller is not None:
            refused = self.leader.load_controller_state(controller)
            if refused is not None:
                self.parts.logger.info(refused)
        self.prompt_frontier, self.prompt_holes = stream["frontier"], list(stream["holes"])
        self._drawn = self.prompt_frontier
        restored = 0
        if self.is_trainer:
            restored = restore_shard(self.shard, checkpoints.read_files("replay-shard"), len(self.trainer_ranks), self.ledger)
        count = torch.tensor([restored], dtype=torch.long)
        dist.all_reduce(count)
        self.parts.logger.info(
            f"restored {int(count.item())} replay-buffer samples; {len(self.prompt_holes)} prompts admitted but not "
            f"delivered at the checkpoint are generated again; the stream continues at draw {self.prompt_frontier}"
        )
