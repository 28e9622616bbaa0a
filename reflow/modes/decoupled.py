"""Decoupled modes: trainer ranks train from their replay-buffer shard while rollout ranks stream samples.

    one_step_off   sigma = 0, delta = 1, sync every step: generation for step t+1 overlaps training step t
    async          sigma = 0, delta = k (replay.delta), sync every weight_sync.interval steps, no replay
    reflow         sigma, tau, delta from [replay]: bounded replay lets the trainer step on fewer fresh samples

Control-plane protocol (who waits for whom, and why it cannot deadlock)
-----------------------------------------------------------------------
Planes: the data plane (rollout -> trainer shards) and the control plane (trainer rank 0 -> rollout
ranks) each run on their own gloo group, one background thread per process and plane
(``reflow.dataplane``). Collectives happen only on the main threads:

  trainer ranks   loop: drain the data inbox into the buffer shard; all-reduce(MIN) "my shard can serve a
                  batch" over the trainer group; if not everyone can, sleep 2 ms (counted as trainer idle)
                  and repeat; else train one step. After every ``interval`` steps (a sync point) rank 0
                  sends SYNC(v) to every rollout rank, all trainer ranks evict samples older than delta
                  versions, then join the weight sync (trainer-mesh gathers + broadcast to rollout ranks).
  rollout ranks   loop: poll the control inbox between engine steps (never inside one); admit new groups
                  while this version's budget (B_max / R samples) lasts; step the engine; every finished
                  group is scored and put on the data outbox at once (the send happens on the thread).
                  On SYNC(v): hold in-flight requests with their prefix (partial rollout), join the weight
                  sync, resume the held requests, reset the budget. With nothing to do, block on the
                  control inbox (counted as rollout idle).

No deadlock: (1) the weight sync is the only collective both roles join, and both enter it only for a
SYNC(v) that trainer rank 0 sent in step order; a rollout rank reaches it after at most one engine step.
(2) The trainer waits only for fresh samples that are already dispatched or dispatchable: each version's
budget B_max >= batch x interval (validated), spread evenly over the shards, and delta >= interval
(validated), so samples of the current rollout version stay in the window until the next sync. Samples
that fall out of the window are evicted at sync points and before each batch is planned. (3) At the end rank 0 sends STOP; rollout ranks drop
their in-flight requests and send END on the data plane; trainers drain until END from every rollout
rank. Every thread exits; nothing sent is left unreceived.
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
from reflow.modes.rollouts import assign_advantages, make_group_requests, score, to_batch
from reflow.replay import ReplayBuffer, build_filter, build_sampler
from reflow.tasks.base import iterate_epochs


@dataclass(frozen=True)
class ModeSettings:
    sigma: float
    tau: float
    delta: int
    interval: int
    b_max: int


def resolve_settings(cfg: JobConfig) -> ModeSettings:
    """The replay/staleness/sync settings each decoupled mode implies (one place, no hidden rewrites)."""
    t, rp = cfg.training, cfg.replay
    batch = t.prompts_per_step * t.group_size
    if t.mode == "one_step_off":
        sigma, tau, delta, interval = 0.0, 1.0, 1, 1
    elif t.mode == "async":
        sigma, tau, delta, interval = 0.0, 1.0, rp.delta, cfg.weight_sync.interval
    elif t.mode == "reflow":
        sigma, tau, delta, interval = rp.sigma, rp.tau, rp.delta, cfg.weight_sync.interval
    else:
        raise ValueError(f"training.mode {t.mode!r} is not a decoupled mode")
    b_max = cfg.rollout.b_max or batch * interval
    return ModeSettings(sigma=sigma, tau=tau, delta=delta, interval=interval, b_max=b_max)


class DecoupledMode(ModeBase):
    def __init__(self, c: Components):
        super().__init__(c)
        self.name = c.cfg.training.mode
        self.s = resolve_settings(c.cfg)
        p = c.placement
        t = c.cfg.training
        self.batch_local = t.prompts_per_step * t.group_size // p.num_trainer_ranks
        # planes: created by every rank at the same point (new_group is collective)
        data_group = dist.new_group(backend="gloo")
        control_group = dist.new_group(backend="gloo")
        self.rollout_only = [r for r in p.rollout_ranks if not p.is_trainer(r)]
        self.control = ControlChannel(control_group, c.rank, p.trainer_ranks[0], self.rollout_only)
        self.is_trainer = p.is_trainer(c.rank)
        if self.is_trainer and not p.is_rollout(c.rank):
            c.engine.sleep()  # built only because engine construction is collective; frees GPU memory
        if self.is_trainer:
            self.inbox = Inbox(data_group, self.rollout_only, "data")
            self.buffer = ReplayBuffer(
                self.s.sigma,
                self.s.delta,
                build_sampler(c.cfg.replay.sampler),
                build_filter(c.cfg.replay.filter, c.cfg.replay.filter_reward_low, c.cfg.replay.filter_reward_high),
                seed=c.cfg.job.seed + c.rank,
            )
            self.rollout_stats: dict[int, dict] = {}
        else:
            self.outbox = Outbox(data_group, "data")
        self.ledger = {"sent": [], "received": [], "consumed_fresh": [], "evicted": 0, "dropped_at_stop": 0}

    # ================================================================ trainer side

    def _receive(self) -> None:
        for m in self.inbox.drain():
            if m.kind != DATA:
                continue
            if m.body["type"] == "group":
                self.buffer.add(m.body["samples"])
                self.ledger["received"].extend(s.uid for s in m.body["samples"])
            elif m.body["type"] == "stats":
                self.rollout_stats[m.src] = m.body

    def _wait_for_batch(self) -> None:
        """Block (idle) until every trainer shard can serve a batch; all trainer ranks leave together."""
        c = self.c
        while True:
            self._receive()
            # a long-tail sample can finish after its policy version left the window: never train on it
            self.ledger["evicted"] += self.buffer.evict_stale(self.version)
            ready = torch.tensor([1 if self.buffer.can_serve(self.batch_local) else 0])
            dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=c.trainer_group)
            if ready.item():
                return
            time.sleep(0.002)

    def _trainer_sync(self) -> None:
        c = self.c
        if c.rank == self.control.leader:
            self.control.broadcast({"cmd": "sync", "version": self.version})
        self.ledger["evicted"] += self.buffer.evict_stale(self.version)
        c.weight_sync.sync(c.trainer, c.engine, self.version)

    def train_one_step(self, step: int) -> dict:
        c = self.c
        timer = StepTimer()
        with timer("wait"):
            self._wait_for_batch()
        plan = self.buffer.plan_batch(self.batch_local)
        samples = plan.fresh + plan.replayed
        weights = [1.0] * len(plan.fresh) + [self.s.tau] * len(plan.replayed)
        staleness = max((self.version - s.birth_version for s in samples), default=0)
        batch = to_batch(samples, c.tokenizer.pad_id, weights)
        with timer("train"):
            stats = c.trainer.train_step(batch)
        self.buffer.give_back(plan)
        self.ledger["consumed_fresh"].extend(s.uid for s in plan.fresh)
        self._drawn = max([self._drawn] + [s.draw + 1 for s in plan.fresh])
        self.version += 1
        with timer("sync"):
            if self.version % self.s.interval == 0:
                self._trainer_sync()
        row = self.step_metrics(plan.fresh, samples, stats, timer, trainer_wait_s=timer.get("wait"), rollout_wait_s=0.0)
        counts = torch.tensor([len(plan.fresh), len(plan.replayed), staleness, len(self.buffer)], dtype=torch.float64)
        mx = counts[2:].clone()
        dist.all_reduce(counts[:2], group=c.trainer_group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=c.trainer_group)
        fresh, replayed = int(counts[0]), int(counts[1])
        lam = replayed / max(fresh + replayed, 1)
        row.update(
            fresh_samples=fresh,
            replayed_samples=replayed,
            replay_fraction=lam,
            alpha=replay_gradient_share(lam, self.s.tau),
            staleness_max=int(mx[0]),
            buffer_size_max=int(mx[1]),
            rollout_idle_ratio=self._rollout_idle_ratio(),
        )
        return row

    def _rollout_idle_ratio(self) -> float:
        idle = sum(s["idle_s"] for s in self.rollout_stats.values())
        busy = sum(s["busy_s"] for s in self.rollout_stats.values())
        return idle / (idle + busy) if idle + busy > 0 else 0.0

    # ================================================================ rollout side

    def _rollout_loop(self) -> None:
        c = self.c
        cfg = c.cfg
        t = cfg.training
        ridx = self.rollout_only.index(c.rank)
        R, A = len(self.rollout_only), c.placement.num_trainer_ranks
        budget = self.s.b_max // R
        stream = iterate_epochs(c.train_problems, cfg.job.seed)
        draw = 0
        # resume: skip the prompts the checkpointed run already used
        while draw < self._drawn:
            next(stream)
            draw += 1
        dispatched, groups_sent = 0, 0
        pending: dict[str, list] = {}
        busy = idle = 0.0
        last_report = time.time()
        stop = False
        waited: list[dict] = []  # a command taken by the idle wait, handled at the top of the loop
        while not stop:
            commands, waited = waited + self.control.poll(), []
            for cmd in commands:
                if cmd["cmd"] == "stop":
                    stop = True
                    break
                held = c.engine.hold_all()
                c.weight_sync.sync(None, c.engine, cmd["version"])
                for req in held:  # partial rollouts continue from their prefix
                    c.engine.add(req)
                dispatched = 0
                self._report(busy, idle)
                busy = idle = 0.0
            if stop:
                break
            # admit whole groups while this version's budget and the engine's capacity last
            while dispatched + t.group_size <= budget and c.engine.num_active + t.group_size <= cfg.rollout.max_num_seqs:
                while draw % R != ridx:
                    next(stream)
                    draw += 1
                problem = next(stream)
                for req in make_group_requests(
                    problem, draw, c.task, c.tokenizer, t.group_size, cfg.rollout.max_new_tokens, cfg.job.seed, c.engine.version
                ):
                    c.engine.add(req)
                draw += 1
                dispatched += t.group_size
            if c.engine.num_active:
                t0 = time.perf_counter()
                for req in c.engine.step():
                    pending.setdefault(req.meta["group"], []).append(req)
                    if len(pending[req.meta["group"]]) == t.group_size:
                        group = score(pending.pop(req.meta["group"]), c.task, c.tokenizer)
                        assign_advantages(group, t.normalize_adv_std, t.advantage_eps)
                        shard = c.placement.trainer_ranks[(groups_sent + ridx) % A]
                        self.outbox.put(shard, {"type": "group", "samples": group})
                        self.ledger["sent"].extend(s.uid for s in group)
                        groups_sent += 1
                busy += time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                cmd = self.control.wait(timeout=0.05)
                idle += time.perf_counter() - t0
                if cmd is not None:
                    waited.append(cmd)
            if time.time() - last_report > 1.0:
                self._report(busy, idle)
                busy = idle = 0.0
                last_report = time.time()
        self.ledger["dropped_at_stop"] = len(c.engine.hold_all()) + sum(len(v) for v in pending.values())

    def _report(self, busy: float, idle: float) -> None:
        self.outbox.put(self.control.leader, {"type": "stats", "busy_s": busy, "idle_s": idle})

    # ================================================================ both

    def run(self) -> list[dict]:
        self.resume()
        history = []
        if self.is_trainer:
            history = self.train_loop()
            if self.c.rank == self.control.leader:
                self.control.broadcast({"cmd": "stop"})
            # drain until END from every rollout rank
            while not self.inbox.done:
                self._receive()
                time.sleep(0.005)
            self._receive()
            self.inbox.join()
            self.ledger["left_in_buffer"] = len(self.buffer)
        else:
            self._rollout_loop()
            self.outbox.close(self.c.placement.trainer_ranks)
        self.control.close()
        self._write_ledger()
        return history

    def prompts_drawn(self) -> int:
        """The furthest prompt any trainer shard has consumed (rollout ranks resume after it)."""
        d = torch.tensor([self._drawn], dtype=torch.long)
        dist.all_reduce(d, op=dist.ReduceOp.MAX, group=self.c.trainer_group)
        return int(d.item())

    def _write_ledger(self) -> None:
        path = os.path.join(self.c.cfg.job.dump_folder, "ledger", f"rank{self.c.rank}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"rank": self.c.rank, "trainer": self.is_trainer, **self.ledger}, f)
