"""Decoupled modes: trainer ranks train from their replay-buffer shard while rollout ranks stream samples.

What each mode is (``resolve_settings``); b = training.prompts_per_step x training.group_size:

    one_step_off  sigma 0, delta 1, sync every step, window 2b (steps_ahead 1), and a shard trains only
                  samples exactly one version old: the batch the previous policy began, while the current
                  policy generates the next one (verl's one_step_off_policy recipe). After the first step
                  every trained sample has staleness exactly 1. One difference from verl, which finishes
                  the previous batch on the old weights before it syncs: a sample still generating at the
                  sync continues under the new weights (a partial rollout, as in async). Its staleness,
                  counted from its oldest token, is still 1, and the baseline is no weaker for it.
    async         sigma 0, delta = replay.delta, sync every weight_sync.interval = k steps, partial
                  rollouts held across syncs, window (steps_ahead + 1) x b with steps_ahead = delta - k + 1
                  (the paper's VeRL-async; verl fully_async, AReaL's max_head_offpolicyness and Tinker's
                  sampling_steps_ahead bound the work ahead of the trainer the same way). Why that
                  steps_ahead: a sample started when the trainer has done s steps runs on weights no older
                  than s - (k - 1); if samples finish in the order they start, at most (steps_ahead + 1) x b
                  are ahead of it and b are consumed per step, so it is trained by version s + steps_ahead,
                  at staleness <= steps_ahead + k - 1 = delta: the largest look-ahead at which nothing is
                  generated in vain. A long-tail sample overtaken by later ones can still exceed delta
                  (shards take samples in arrival order); it is then evicted, never trained.
    reflow        sigma, tau, delta, k from the config, and the paper's dispatch rule: B_max samples may
                  start per trainer step (rollout.b_max, default b), whatever the step consumed; bounded
                  replay lets a shard step on b(1 - sigma) fresh samples, so generation runs ahead.

The dispatch rule lives in one place, ``reflow.scheduler.DispatchBudget``: per (rollout rank, trainer
shard) pair, whole groups, destination shard fixed at admission. A sample is *started* when admitted to an
engine and *retired* when trained for the first time or evicted unused.

Control-plane protocol (who waits for whom, and why it cannot deadlock)
-----------------------------------------------------------------------
Planes: the data plane (rollout -> trainer shards) and the control plane (trainer rank 0 -> rollout
ranks) each run on their own gloo group, one background thread per process and plane
(``reflow.dataplane``). Collectives happen only on the main threads:

  trainer ranks   loop: drain the data inbox into the buffer shard; evict samples staler than delta;
                  all-reduce(SUM) over the trainer group of "my shard cannot serve a batch yet" and of
                  the retired counts (per rollout rank and shard); rank 0 sends each rollout rank a
                  Progress with its row whenever the counts changed; if some shard is not ready, sleep
                  2 ms (trainer idle) and repeat; else train one step. After the step: at a sync point
                  (every k steps) rank 0 sends SyncWeights(v), every trainer rank evicts, then joins the
                  weight sync (trainer-mesh gathers + broadcast to rollout ranks); then the same
                  all-reduce, and rank 0 sends Progress(steps done, retired), after SyncWeights.
  rollout ranks   loop (``rollout_worker``): take commands between engine steps, never inside one.
                  SyncWeights(v): step until every admitted request has its first token, hold in-flight
                  requests with their prefix (partial rollout), join the weight sync, resume them.
                  Progress: update the dispatch budget. Then admit whole groups while the budget has room
                  on some shard and the engine has capacity; step the engine; every finished group is
                  scored and put on the data outbox at once. With nothing in flight, block on the control
                  inbox (rollout idle).

Invariants the argument uses. (I1) A sample's birth version (oldest token) is the engine version it was
admitted under: the first-token rule at SyncWeights. (I2) Commands arrive in the order sent, and a rollout
rank admits what a Progress grants before it applies the next command. So the room granted after step s
is admitted after the SyncWeights of step s and before the next one: on weights no older than s - (k - 1),
and, with k = 1, exactly s. (I3) Every shard owns a fixed share of each limit (whole groups),
at least b/A over the rollout ranks (A trainer shards; training.prompts_per_step is a multiple of A).

No deadlock. (1) The weight sync is the only collective both roles join; both enter it only for a
SyncWeights(v) that trainer rank 0 sent in step order, and a rollout rank reaches it after finishing the
engine steps that give its newest requests their first token. (2) A waiting shard is eventually served.
While the trainer waits at version v nothing it holds ages, and the engines keep stepping. Window modes:
every sample of a shard's window share (>= 2b/A) either arrives within delta and stays unused there, or
arrives stale, is evicted, retired and replaced by one started on weights no older than v - (k - 1) >=
v - delta, which cannot go stale while the trainer waits; so the share ends up unused in the shard, and
b/A of it is enough. reflow: the share granted after the last step (>= b/A) was started after it (I2),
cannot have been consumed yet and does not go stale, so >= b/A >= b(1 - sigma)/A unused samples arrive.
one_step_off (window 2b, k = 1, eligible = born at v - 1): by induction on v from the version the run
started or resumed at (where every sample is born and the floor is 0), each shard gets exactly b/A samples
born at v - 1 and b/A born at v, because the room a step's Progress grants is what that step
consumed, and all of it is admitted at once (validated: rollout.max_num_seqs holds a rank's whole share of
the window; I1, I2). (3) At the end rank 0 sends Stop; rollout ranks drop their in-flight requests and
send END on the data plane; trainers drain until END from every rollout rank. Every thread exits; nothing
sent is left unreceived.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reflow.algorithms.grpo import replay_gradient_share
from reflow.config.job_config import JobConfig
from reflow.dataplane import ControlChannel, Inbox, Outbox
from reflow.dataplane.transport import DATA
from reflow.modes.base import Components, ModeBase, StepTimer
from reflow.modes.commands import Progress, Stop, SyncWeights
from reflow.modes.rollout_worker import PromptShare, RolloutWorker
from reflow.modes.rollouts import Sample, to_batch
from reflow.replay import ReplayBuffer, build_filter, build_sampler
from reflow.scheduler import DispatchBudget, DispatchRule


@dataclass(frozen=True)
class ModeSettings:
    sigma: float
    tau: float
    delta: int
    interval: int
    min_staleness: int
    """A shard trains an unused sample only once it is at least this stale (one_step_off: 1)."""
    steps_ahead: int
    """Window modes: batches generation may run ahead of the one being trained (0 for reflow)."""
    dispatch: DispatchRule


def resolve_settings(cfg: JobConfig) -> ModeSettings:
    """The replay, staleness, sync and dispatch settings each decoupled mode implies (one place, no hidden
    rewrites of the config)."""
    training, replay = cfg.training, cfg.replay
    batch = training.prompts_per_step * training.group_size
    if training.mode == "one_step_off":
        return ModeSettings(
            sigma=0.0, tau=1.0, delta=1, interval=1, min_staleness=1, steps_ahead=1, dispatch=DispatchRule(window=2 * batch)
        )
    if training.mode == "async":
        interval = cfg.weight_sync.interval
        steps_ahead = replay.delta - interval + 1
        return ModeSettings(
            sigma=0.0, tau=1.0, delta=replay.delta, interval=interval, min_staleness=0, steps_ahead=steps_ahead,
            dispatch=DispatchRule(window=(steps_ahead + 1) * batch),
        )
    if training.mode == "reflow":
        return ModeSettings(
            sigma=replay.sigma, tau=replay.tau, delta=replay.delta, interval=cfg.weight_sync.interval, min_staleness=0,
            steps_ahead=0, dispatch=DispatchRule(per_step=cfg.rollout.b_max or batch),
        )
    raise ValueError(f"training.mode {training.mode!r} is not a decoupled mode")


class DecoupledMode(ModeBase):
    def __init__(self, parts: Components):
        super().__init__(parts)
        cfg, placement = parts.cfg, parts.placement
        self.name = cfg.training.mode
        self.settings = resolve_settings(cfg)
        self.max_staleness = self.settings.delta
        self.trainer_ranks = placement.trainer_ranks
        self.rollout_ranks = [r for r in placement.rollout_ranks if not placement.is_trainer(r)]
        self.batch_per_shard = cfg.training.prompts_per_step * cfg.training.group_size // len(self.trainer_ranks)
        # planes: created by every rank at the same point (new_group is collective)
        data_group = dist.new_group(backend="gloo")
        control_group = dist.new_group(backend="gloo")
        self.control = ControlChannel(control_group, parts.rank, self.trainer_ranks[0], self.rollout_ranks)
        self.is_trainer = placement.is_trainer(parts.rank)
        self.steps_done = 0
        if self.is_trainer:
            if not placement.is_rollout(parts.rank):
                parts.engine.sleep()  # built only because engine construction is collective; frees GPU memory
            self.shard_index = self.trainer_ranks.index(parts.rank)
            self.inbox = Inbox(data_group, self.rollout_ranks, "data")
            self.buffer = ReplayBuffer(
                self.settings.sigma,
                self.settings.delta,
                build_sampler(cfg.replay.sampler),
                build_filter(cfg.replay.filter, cfg.replay.filter_reward_low, cfg.replay.filter_reward_high),
                seed=cfg.job.seed + parts.rank,
                min_staleness=self.settings.min_staleness,
            )
            self.retired = [0] * len(self.rollout_ranks)  # this shard's retirements, per rollout rank
            self.published: tuple | None = None  # rank 0: the last progress sent to the rollout ranks
            self.rollout_stats: dict[int, dict] = {}
            self.ledger: dict = {"received": [], "consumed": [], "steps": [], "evicted_unused": [], "evicted_replayable": 0}
        else:
            self.outbox = Outbox(data_group, "data")

    # ================================================================ trainer side

    def _receive(self) -> None:
        for message in self.inbox.drain():
            if message.kind != DATA:
                continue
            if message.body["type"] == "group":
                self.buffer.add(message.body["samples"])
                self.ledger["received"].extend(s.uid for s in message.body["samples"])
            elif message.body["type"] == "stats":
                self.rollout_stats[message.src] = message.body

    def _evict_stale(self) -> None:
        """A long-tail sample can finish after its version left the window: never train on it; retire it."""
        for sample in self.buffer.evict_stale(self.version):
            if sample.use_count == 0:
                self._retire(sample)
                self.ledger["evicted_unused"].append(sample.uid)
            else:
                self.ledger["evicted_replayable"] += 1

    def _retire(self, sample: Sample) -> None:
        self.retired[sample.origin] += 1

    def _exchange_progress(self, not_ready: bool) -> bool:
        """All trainer ranks: are all shards ready? Rank 0 also tells the rollout ranks what was retired.

        One all-reduce(SUM) of [not-ready flags, retired[rollout rank][shard]] over the trainer group."""
        num_rollout, num_shards = len(self.rollout_ranks), len(self.trainer_ranks)
        counts = torch.zeros(1 + num_rollout * num_shards, dtype=torch.long)
        counts[0] = int(not_ready)
        for rollout in range(num_rollout):
            counts[1 + rollout * num_shards + self.shard_index] = self.retired[rollout]
        dist.all_reduce(counts, group=self.parts.trainer_group)
        if self.parts.rank == self.control.leader:
            retired = counts[1:].view(num_rollout, num_shards).tolist()
            progress = (self.steps_done, tuple(tuple(row) for row in retired))
            if progress != self.published:
                self.published = progress
                for rollout, rank in enumerate(self.rollout_ranks):
                    self.control.send(rank, Progress(self.steps_done, tuple(retired[rollout])))
        return counts[0].item() == 0

    def _wait_for_batch(self) -> None:
        """Block (idle) until every trainer shard can serve a batch; all trainer ranks leave together."""
        while True:
            self._receive()
            self._evict_stale()
            ready = self.buffer.can_serve(self.batch_per_shard, self.version)
            if self._exchange_progress(not_ready=not ready):
                return
            time.sleep(0.002)

    def _sync_weights(self) -> None:
        parts = self.parts
        if parts.rank == self.control.leader:
            self.control.broadcast(SyncWeights(self.version))
        self._evict_stale()
        parts.weight_sync.sync(parts.trainer, parts.engine, self.version)

    def train_one_step(self, step: int) -> dict:
        parts = self.parts
        timer = StepTimer()
        # 1. wait until every shard can serve a batch (fresh samples within the staleness bounds)
        with timer("wait"):
            self._wait_for_batch()
        # 2. plan: fresh samples (arrival order), replayed ones up to sigma, each with its loss weight
        plan = self.buffer.plan_batch(self.batch_per_shard, self.version)
        trained = plan.fresh + plan.replayed
        weights = [1.0] * len(plan.fresh) + [self.settings.tau] * len(plan.replayed)
        batch = to_batch(trained, parts.tokenizer.pad_id, weights)
        self.ledger["consumed"].extend(
            {"uid": s.uid, "step": step, "staleness": s.staleness(self.version)} for s in plan.fresh
        )
        # 3. train, then hand consumed samples to the replay filter; first uses retire their samples
        train_start = time.time()
        with timer("train"):
            stats = parts.trainer.train_step(batch)
        self.ledger["steps"].append({"step": step, "version": self.version, "train_start": train_start, "train_end": time.time()})
        self.buffer.give_back(plan)
        for sample in plan.fresh:
            self._retire(sample)
        self._drawn = max([self._drawn] + [s.draw + 1 for s in plan.fresh])
        trained_version = self.version
        self.version += 1
        self.steps_done = step
        # 4. weight sync at sync points; then tell the rollout ranks (after SyncWeights, in order)
        with timer("sync"):
            if self.version % self.settings.interval == 0:
                self._sync_weights()
        self._exchange_progress(not_ready=False)
        # 5. metrics over the trainer ranks
        row = self.step_metrics(
            plan.fresh, trained, stats, timer, trained_version, trainer_wait_s=timer.get("wait"), rollout_wait_s=0.0
        )
        counts = torch.tensor([len(plan.fresh), len(plan.replayed)], dtype=torch.float64)
        dist.all_reduce(counts, group=parts.trainer_group)
        buffered = torch.tensor([len(self.buffer)], dtype=torch.float64)
        dist.all_reduce(buffered, op=dist.ReduceOp.MAX, group=parts.trainer_group)
        fresh, replayed = int(counts[0]), int(counts[1])
        replay_fraction = replayed / max(fresh + replayed, 1)
        row.update(
            fresh_samples=fresh,
            replayed_samples=replayed,
            replay_fraction=replay_fraction,
            alpha=replay_gradient_share(replay_fraction, self.settings.tau),
            buffer_size_max=int(buffered.item()),
            rollout_idle_ratio=self._rollout_idle_ratio(),
        )
        return row

    def _rollout_idle_ratio(self) -> float:
        idle = sum(s["idle_s"] for s in self.rollout_stats.values())
        busy = sum(s["busy_s"] for s in self.rollout_stats.values())
        return idle / (idle + busy) if idle + busy > 0 else 0.0

    # ================================================================ both

    def run(self) -> list[dict]:
        self.resume()
        self.steps_done = self.step
        history = []
        if self.is_trainer:
            self.buffer.start_version = self.version  # the engines start (or resume) on this version
            history = self.train_loop()
            if self.parts.rank == self.control.leader:
                self.control.broadcast(Stop())
            # drain until END from every rollout rank
            while not self.inbox.done:
                self._receive()
                time.sleep(0.005)
            self._receive()
            self.inbox.join()
            self.ledger["left_unused"] = [s.uid for s in self.buffer.unused]
            self.ledger["left_replayable"] = len(self.buffer.replayable)
        else:
            worker = self._build_rollout_worker()
            worker.run()
            self.outbox.close(self.trainer_ranks)
            self.ledger = worker.ledger
        self.control.close()
        self._write_ledger()
        return history

    def _build_rollout_worker(self) -> RolloutWorker:
        parts = self.parts
        index = self.rollout_ranks.index(parts.rank)
        budget = DispatchBudget(
            self.settings.dispatch, index, len(self.rollout_ranks), len(self.trainer_ranks),
            parts.cfg.training.group_size, start_step=self.step,
        )
        prompts = PromptShare(parts.train_problems, parts.cfg.job.seed, index, len(self.rollout_ranks), first_draw=self._drawn)
        return RolloutWorker(parts, self.control, self.outbox, budget, prompts, index)

    def prompts_drawn(self) -> int:
        """The furthest prompt any trainer shard has consumed (rollout ranks resume after it)."""
        drawn = torch.tensor([self._drawn], dtype=torch.long)
        dist.all_reduce(drawn, op=dist.ReduceOp.MAX, group=self.parts.trainer_group)
        return int(drawn.item())

    def _write_ledger(self) -> None:
        path = os.path.join(self.parts.cfg.job.dump_folder, "ledger", f"rank{self.parts.rank}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"rank": self.parts.rank, "trainer": self.is_trainer, **self.ledger}, f)
