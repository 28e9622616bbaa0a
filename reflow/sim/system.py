"""The whole system in simulated time: rollout engines, trainer shards and the control loop of each mode,
built on the real scheduling classes (``DispatchBudget``, ``GroupDispatcher``, ``ShardRouter``, ``plan_moves``,
``ReplayBuffer``, ``ConcurrencyController``, ``KVAdmission``, ``PlacementPlanner``, ``resolve_settings``), so the
simulator runs the decisions the live system runs, at 8 to 128 GPUs.

Decoupled modes, one trainer step (``DecoupledSim.run``):

  1. wait     advance the engine with the earliest clock, one macro-step at a time, delivering each finished
              group (stamped with its finish version) to the shard the router picks, until every shard can
              serve exactly b/A samples (the trainer waits); shards short of samples take others' surplus
              (``plan_moves``)
  2. train    plan every shard's batch (fresh earliest deadline first, replayed up to sigma), train for the
              slowest rank's tokens while every engine runs on to the end of the step
  3. retire   first uses retire their samples; every rollout engine's budget learns the counts (Progress), and
              with scheduler.kv_admission the global dispatcher deals the new room by the engines' KV loads
  4. sync     every k steps: the trainer and every engine pause for the weight sync; engines admit new
              groups at the new version, sequences in flight keep their birth version (partial rollouts)
  5. place    at sync points the placement controller (the planner) may move ranks: every engine finishes
              what it has in flight, the transition costs its measured seconds, leaving shards hand their
              samples to staying ones, and budgets restart at this step (as ``DecoupledMode._transition``)

``sync`` mode: every GPU generates its share of the batch to completion, then every GPU trains, then syncs.

Simplifications, stated: commands and samples travel instantly; engines admit between macro-steps (a few
decode steps) rather than between single steps; one global prompt stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from reflow.config.job_config import JobConfig
from reflow.modes.settings import resolve_settings
from reflow.replay import BufferedSample, ReplayBuffer, build_filter, build_sampler
from reflow.scheduler import DispatchBudget, PlacementPlanner, PlannerSettings
from reflow.scheduler.dispatch import GroupDispatcher, WorkerReport
from reflow.scheduler.routing import ShardCounts, ShardRouter, plan_moves
from reflow.scheduler.concurrency import (
    AdmissionRule,
    ConcurrencyController,
    ConcurrencySettings,
    KVAdmission,
    ResponseLengths,
    groups_in_flight,
)
from reflow.sim.engine import SimEngine, SimSequence
from reflow.sim.profiles import CostProfile
from reflow.sim.workload import Workload


@dataclass(frozen=True)
class SimConfig:
    mode: str
    gpus: int
    prompts_per_step: int
    group_size: int
    steps: int
    replicas: int = 1
    """Trainer replicas at the start (decoupled modes)."""
    shard_degree: int = 1
    sigma: float = 0.5
    tau: float = 0.5
    delta: int = 2
    interval: int = 2
    b_max: int = 0
    adaptive_concurrency: bool = False
    kv_admission: bool = False
    adaptive_placement: bool = False
    rho: float = 0.9
    response_percentile: float = 0.9
    cooldown_steps: int = 4
    margin: float = 0.1
    horizon_steps: int = 20
    warmup_steps: int = 3
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size

    def job_config(self) -> JobConfig:
        cfg = JobConfig()
        cfg.training.mode = self.mode
        cfg.training.prompts_per_step, cfg.training.group_size = self.prompts_per_step, self.group_size
        cfg.replay.sigma, cfg.replay.tau, cfg.replay.delta = self.sigma, self.tau, self.delta
        cfg.weight_sync.interval = self.interval
        cfg.rollout.b_max = self.b_max
        return cfg


@dataclass
class StepRecord:
    step: int
    start: float
    end: float
    wait_s: float
    trainer_tokens: int
    received: int
    fresh: int
    replayed: int
    rollout_busy_s: float
    rollout_idle_s: float
    placement: str
    staleness: list[int] = field(default_factory=list)

    def as_row(self) -> dict:
        """The live decoupled rows' keys the placement planner reads."""
        return {
            "step_time_s": self.end - self.start, "trainer_wait_s": self.wait_s, "received_samples": self.received,
            "fresh_samples": self.fresh, "replayed_samples": self.replayed, "rollout_busy_s": self.rollout_busy_s,
            "rollout_idle_s": self.rollout_idle_s,
        }


def summarize(records: list[StepRecord], warmup: int, transitions: list[dict]) -> dict:
    kept = [r for r in records if r.step > warmup] or records
    seconds = sum(r.end - r.start for r in kept)
    busy = sum(r.rollout_busy_s for r in kept)
    idle = sum(r.rollout_idle_s for r in kept)
    return {
        "tokens_per_s": sum(r.trainer_tokens for r in kept) / max(seconds, 1e-9),
        "trainer_idle_ratio": sum(r.wait_s for r in kept) / max(seconds, 1e-9),
        "rollout_idle_ratio": idle / max(busy + idle, 1e-9),
        "steps": len(records),
        "seconds": records[-1].end if records else 0.0,
        "step_time_s": seconds / max(len(kept), 1),
        "timeline": [{"step": r.step, "end_s": round(r.end, 3), "placement": r.placement} for r in records],
        "transitions": transitions,
    }


class _Rollout:
    """One simulated rollout rank: its engine, dispatch budget and admission rule (the live gate's)."""

    def __init__(
        self, engine: SimEngine, budget: DispatchBudget, router: ShardRouter, index: int, cfg: SimConfig, profile: CostProfile,
        workload: Workload,
    ):
        self.engine, self.budget, self.router, self.index = engine, budget, router, index
        self.prompt_tokens, self.group_size = workload.prompt_tokens, cfg.group_size
        self.lengths = ResponseLengths(cfg.response_percentile, window=256, initial=workload.max_tokens)
        self.rule = AdmissionRule(
            profile.max_num_seqs,
            ConcurrencyController(ConcurrencySettings(min_cap=cfg.group_size, max_cap=profile.max_num_seqs), profile.max_num_seqs)
            if cfg.adaptive_concurrency else None,
            KVAdmission(cfg.rho, self.lengths, profile.kv_block_size) if cfg.kv_admission else None,
        )

    def groups_in_flight(self) -> list[tuple[int, list[int]]]:
        engine = self.engine
        return groups_in_flight((seq.group, seq.prompt_tokens, seq.generated) for seq in engine.running + engine.waiting + engine.in_tool)

    def allows(self, prompt_tokens: int, group_size: int) -> bool:
        engine = self.engine
        return self.rule.refuses(engine.num_active, engine.profile.kv_budget_tokens, prompt_tokens, group_size, self.groups_in_flight) is None

    def report(self) -> WorkerReport:
        """What the global dispatcher weighs, read exactly (a live worker reports it about once a second)."""
        engine = self.engine
        load, estimate = self.rule.load(
            engine.num_active, engine.profile.kv_budget_tokens, self.prompt_tokens, self.group_size, self.groups_in_flight()
        )
        return WorkerReport(load, estimate, self.budget.started)

    def observe(self, finished: list[SimSequence]) -> None:
        for seq in finished:
            self.lengths.add(seq.generated)
        if self.rule.controller:
            engine = self.engine
            self.rule.controller.observe(engine.clock, engine.kv_usage(), engine.profile.kv_budget_tokens, engine.num_active, engine.preemptions)


class DecoupledSim:
    def __init__(self, cfg: SimConfig, profile: CostProfile, workload: Workload):
        self.cfg, self.profile, self.workload = cfg, profile, workload
        self.settings = resolve_settings(cfg.job_config())
        self.rng = random.Random(cfg.seed)
        self.version = 0
        self.steps_done = 0
        self.clock = 0.0
        self.draws = 0
        self.tokens: dict[str, int] = {}
        self.partial: dict[str, list[SimSequence]] = {}
        self.shards: list[ReplayBuffer] = []
        self.rollouts: list[_Rollout] = []
        self.records: list[StepRecord] = []
        self.transitions: list[dict] = []
        self.evicted_unused = 0
        self.received = 0  # samples delivered to the shards during the current step
        self.moved = 0  # samples moved between shards (``plan_moves``)
        self.planner = (
            PlacementPlanner(PlannerSettings(
                world_size=cfg.gpus, shard_degree=cfg.shard_degree,
                replica_options=tuple(range(1, (cfg.gpus - 1) // cfg.shard_degree + 1)), sigma=self.settings.sigma,
                batch_size=cfg.batch, cooldown_steps=cfg.cooldown_steps, margin=cfg.margin, horizon_steps=cfg.horizon_steps,
                transition_cost_s=profile.transition_s,
            ))
            if cfg.adaptive_placement else None
        )
        self.window: list[dict] = []
        self.engines_ever: list[SimEngine] = []  # every engine the run built (for its preemption count)
        self._enter(cfg.replicas)

    # ---- placement ---------------------------------------------------------------------

    @property
    def placement(self) -> str:
        return f"T{self.replicas}x{self.cfg.shard_degree}+R{len(self.rollouts)}"

    def _new_buffer(self, rank: int) -> ReplayBuffer:
        buffer = ReplayBuffer(
            self.settings.sigma, self.settings.delta, build_sampler("random"), build_filter("accept_all"),
            seed=self.cfg.seed + rank, min_staleness=self.settings.min_staleness, anchor=self.settings.anchor,
        )
        buffer.start_version = 0
        return buffer

    def _enter(self, replicas: int) -> None:
        cfg = self.cfg
        self.replicas = replicas
        num_shards = replicas * cfg.shard_degree
        num_rollout = cfg.gpus - num_shards
        leaving = self.shards[num_shards:]
        self.shards = self.shards[:num_shards] + [self._new_buffer(r) for r in range(len(self.shards), num_shards)]
        for index, buffer in enumerate(leaving):  # a leaving shard's samples go to a staying one
            self.shards[index % num_shards].add(buffer.drain())
        for buffer in self.shards:  # the budgets start afresh: no sample counts against an old one
            for sample in buffer.unused + buffer.replayable:
                sample.origin = -1
        self.retired = [0] * num_rollout
        engines = [r.engine for r in self.rollouts]
        kept = engines[len(engines) - num_rollout:] if num_rollout <= len(engines) else engines
        fresh = [SimEngine(self.profile, i) for i in range(num_rollout - len(kept))]
        self.engines_ever.extend(fresh)
        for engine in fresh:
            engine.clock = engine.paused_until = self.clock
            engine.version = self.version
        dealt = cfg.kv_admission  # the global dispatcher deals the room, as in the live system
        self.rollouts = [
            _Rollout(
                engine,
                DispatchBudget(self.settings.dispatch, index, num_rollout, cfg.group_size, start_step=self.steps_done, dealt=dealt),
                ShardRouter(num_shards, first=index), index, cfg, self.profile, self.workload,
            )
            for index, engine in enumerate(fresh + kept)
        ]
        self.dispatcher = (
            GroupDispatcher(self.settings.dispatch, num_rollout, cfg.group_size, cfg.rho, start_step=self.steps_done)
            if dealt else None
        )
        self._tell_budgets()
        for rollout in self.rollouts:
            self._admit(rollout)

    def _transition(self, replicas: int) -> None:
        start = self.clock
        for rollout in self.rollouts:  # finish everything in flight; send it
            while rollout.engine.num_active:
                self._deliver(rollout, rollout.engine.step(float("inf")) or [])
        self.clock = max([self.clock] + [r.engine.clock for r in self.rollouts]) + self.profile.transition_s
        for rollout in self.rollouts:
            rollout.engine.idle_s += self.clock - rollout.engine.clock
            rollout.engine.clock = self.clock
        old = self.placement
        self._enter(replicas)
        event = {"after_step": self.steps_done, "transition": f"{old} -> {self.placement}", "transition_s": self.clock - start}
        self.transitions.append(event)
        self.window.append(event)

    # ---- rollout side --------------------------------------------------------------------

    def _admit(self, rollout: _Rollout) -> None:
        cfg, engine = self.cfg, rollout.engine
        while True:
            if not rollout.budget.can_start() or not rollout.allows(self.workload.prompt_tokens, cfg.group_size):
                return
            draw = self.draws
            self.draws += 1
            group = f"g{draw}"
            sequences = []
            for k in range(cfg.group_size):
                target = self.workload.response_length(self.rng, self.steps_done)
                turns = self.workload.tool_turns
                points = [target * (t + 1) // (turns + 1) for t in range(turns)] if turns else []
                sequences.append(SimSequence(
                    uid=f"{group}/{k}", group=group, draw=draw, prompt_tokens=self.workload.prompt_tokens,
                    target_tokens=target, birth_version=engine.version, origin=rollout.index, turn_points=points,
                    tool_latency_s=self.workload.tool_latency_s,
                ))
            engine.add(sequences)
            rollout.budget.record_start()

    def _deliver(self, rollout: _Rollout, finished: list[SimSequence]) -> None:
        rollout.observe(finished)
        for seq in finished:
            members = self.partial.setdefault(seq.group, [])
            members.append(seq)
            if len(members) < self.cfg.group_size:
                continue
            del self.partial[seq.group]
            samples = []
            for member in members:
                self.tokens[member.uid] = member.prompt_tokens + member.generated
                samples.append(BufferedSample(
                    uid=member.uid, draw=member.draw, group_id=member.group, prompt_ids=[], output_ids=[], logprobs=[],
                    versions=[member.birth_version], reward=0.5, origin=member.origin, advantage=1.0,
                    finish_version=rollout.engine.version,
                ))
            # bound to a shard on arrival: the router sees the shards' counts exactly here (Progress, instantly)
            rollout.router.update([buffer.num_unused for buffer in self.shards])
            buffer = self.shards[rollout.router.choose(len(samples))]
            self.received += len(samples)
            for sample in samples:
                if buffer.is_stale(sample, self.version):
                    self._retire_evicted(sample)
                else:
                    buffer.add([sample])

    def _step_earliest(self) -> float | None:
        """One macro-step of the busy engine with the earliest clock; returns that engine's clock after it
        (None if no engine has work)."""
        busy = [r for r in self.rollouts if r.engine.num_active]
        if not busy:
            return None
        rollout = min(busy, key=lambda r: max(r.engine.clock, r.engine.paused_until))
        self._deliver(rollout, rollout.engine.step(float("inf")) or [])
        self._admit(rollout)
        return rollout.engine.clock

    def _run_engines_to(self, until: float) -> None:
        for rollout in self.rollouts:
            engine = rollout.engine
            while engine.clock < until:
                finished = engine.step(until)
                if finished is None:
                    break
                self._deliver(rollout, finished)
                self._admit(rollout)
            if engine.clock < until and not engine.num_active:
                engine.idle_s += until - engine.clock
                engine.clock = until

    def _tell_budgets(self) -> None:
        """Progress: every budget learns the steps done and retirements, and with the global dispatcher its grants."""
        granted = None
        if self.dispatcher is not None:
            for rollout in self.rollouts:
                self.dispatcher.report(rollout.index, rollout.report())
            granted = self.dispatcher.deal(self.steps_done, self.retired)
        for rollout in self.rollouts:
            rollout.budget.update(self.steps_done, self.retired[rollout.index])
            if granted is not None:
                rollout.budget.grant(granted[rollout.index])
            rollout.router.update([buffer.num_unused for buffer in self.shards])

    # ---- trainer side ----------------------------------------------------------------------

    def _retire(self, sample: BufferedSample) -> None:
        if 0 <= sample.origin < len(self.retired):
            self.retired[sample.origin] += 1

    def _retire_evicted(self, sample: BufferedSample) -> None:
        self.evicted_unused += 1
        self._retire(sample)

    def _evict(self) -> None:
        for buffer in self.shards:
            for sample in buffer.evict_stale(self.version):
                if sample.use_count == 0:
                    self._retire_evicted(sample)

    def _ready(self) -> bool:
        """Every shard can serve exactly b/A; short shards first take others' surplus (moves are instant here)."""
        per_shard = self.cfg.batch // len(self.shards)
        self._evict()
        while True:
            moves = plan_moves([
                ShardCounts(buffer.num_eligible(self.version), buffer.need(per_shard), buffer.num_urgent(self.version), per_shard)
                for buffer in self.shards
            ])
            if not moves:
                return all(buffer.can_serve(per_shard, self.version) for buffer in self.shards)
            for move in moves:
                self.shards[move.receiver].add(self.shards[move.donor].take_eligible(move.first, move.count, self.version))
                self.moved += move.count

    def run(self) -> dict:
        cfg, profile = self.cfg, self.profile
        while self.steps_done < cfg.steps:
            step_start = self.clock
            busy0 = sum(r.engine.busy_s for r in self.rollouts)
            idle0 = sum(r.engine.idle_s for r in self.rollouts)
            self.received = 0
            # 1. wait until every shard can serve a batch (the other engines catch up to that time, and what they
            #    deliver meanwhile goes through the same staleness check)
            while True:
                while not self._ready():
                    delivered = self.received
                    while self.received == delivered:  # the shards change only when a group arrives
                        now = self._step_earliest()
                        if now is None:
                            raise RuntimeError(f"simulated {cfg.mode} deadlocked at step {self.steps_done + 1}: no engine has work")
                        self.clock = max(self.clock, now)
                self._run_engines_to(self.clock)
                if self._ready():
                    break
            ready = self.clock
            # 2. train: every shard's batch; the slowest rank sets the time
            per_shard = cfg.batch // len(self.shards)
            plans = [buffer.plan_batch(per_shard, self.version) for buffer in self.shards]
            rank_tokens = [sum(self.tokens[s.uid] for s in plan.fresh + plan.replayed) for plan in plans]
            staleness = [0] * (self.settings.delta + 1)
            for buffer, plan in zip(self.shards, plans):
                for sample in plan.fresh + plan.replayed:
                    staleness[buffer.staleness(sample, self.version)] += 1
            train_end = ready + profile.train_overhead_s + max(rank_tokens) * profile.train_token_s
            if len(self.shards) > 1:
                train_end += profile.train_collective_s
            self._run_engines_to(train_end)
            self.clock = train_end
            # 3. retire and tell the budgets
            for buffer, plan in zip(self.shards, plans):
                buffer.give_back(plan)
                for sample in plan.fresh:
                    self._retire(sample)
            self.version += 1
            self.steps_done += 1
            # 4. weight sync
            if self.version % self.settings.interval == 0:
                self._evict()
                for rollout in self.rollouts:
                    rollout.engine.paused_until = max(rollout.engine.clock, self.clock) + profile.weight_sync_s
                    rollout.engine.version = self.version
                self.clock += profile.weight_sync_s
            self._tell_budgets()
            for rollout in self.rollouts:
                if not rollout.engine.num_active and rollout.engine.clock < self.clock:
                    rollout.engine.idle_s += self.clock - rollout.engine.clock
                    rollout.engine.clock = self.clock
                self._admit(rollout)
            record = StepRecord(
                step=self.steps_done, start=step_start, end=self.clock, wait_s=ready - step_start,
                trainer_tokens=sum(rank_tokens), received=self.received,
                fresh=sum(len(p.fresh) for p in plans), replayed=sum(len(p.replayed) for p in plans),
                rollout_busy_s=sum(r.engine.busy_s for r in self.rollouts) - busy0,
                rollout_idle_s=sum(r.engine.idle_s for r in self.rollouts) - idle0,
                placement=self.placement, staleness=staleness,
            )
            self.records.append(record)
            self.window.append(record.as_row())
            # 5. placement, at sync points
            if self.planner is not None and self.version % self.settings.interval == 0 and self.steps_done < cfg.steps:
                decision = self.planner.decide(self.steps_done, self.replicas, self.window)
                self.window = []
                if decision.target is not None:
                    self._transition(decision.target)
                    self.transitions[-1]["reason"] = decision.reason
        result = summarize(self.records, cfg.warmup_steps, self.transitions)
        result["evicted_unused"] = self.evicted_unused
        trained_fresh = sum(r.fresh for r in self.records)
        result["evicted_fraction"] = self.evicted_unused / max(self.evicted_unused + trained_fresh, 1)
        result["moved_between_shards"] = self.moved
        result["preemptions"] = sum(engine.preemptions for engine in self.engines_ever)
        result["staleness_counts"] = [sum(r.staleness[k] for r in self.records) for k in range(self.settings.delta + 1)]
        return result


def simulate_sync(cfg: SimConfig, profile: CostProfile, workload: Workload) -> dict:
    """Colocated on-policy GRPO: every GPU generates its share, then every GPU trains, then the sync."""
    rng = random.Random(cfg.seed)
    engines = [SimEngine(profile, i) for i in range(cfg.gpus)]
    clock, records = 0.0, []
    for step in range(1, cfg.steps + 1):
        start = clock
        busy0, idle0 = sum(e.busy_s for e in engines), sum(e.idle_s for e in engines)
        tokens = [0] * cfg.gpus
        for prompt in range(cfg.prompts_per_step):
            rank = prompt % cfg.gpus
            group = f"s{step}-{prompt}"
            engines[rank].add([
                SimSequence(f"{group}/{k}", group, prompt, workload.prompt_tokens,
                            workload.response_length(rng, step - 1), step - 1, rank)
                for k in range(cfg.group_size)
            ])
        for rank, engine in enumerate(engines):
            engine.clock = start
            while engine.num_active:
                for seq in engine.step(float("inf")) or []:
                    tokens[rank] += seq.prompt_tokens + seq.generated
        generated = max(engine.clock for engine in engines)
        train = profile.train_overhead_s + max(tokens) * profile.train_token_s + (profile.train_collective_s if cfg.gpus > 1 else 0.0)
        clock = generated + train + profile.weight_sync_s
        for engine in engines:  # each waits for the slowest, then for training and the sync
            engine.idle_s += clock - engine.clock
            engine.clock = clock
        records.append(StepRecord(
            step=step, start=start, end=clock, wait_s=generated - start, trainer_tokens=sum(tokens),
            received=cfg.batch, fresh=cfg.batch, replayed=0,
            rollout_busy_s=sum(e.busy_s for e in engines) - busy0, rollout_idle_s=sum(e.idle_s for e in engines) - idle0,
            placement=f"T1x{cfg.gpus}+R0",
        ))
    return summarize(records, cfg.warmup_steps, [])


def simulate(cfg: SimConfig, profile: CostProfile, workload: Workload) -> dict:
    if cfg.mode == "sync":
        return simulate_sync(cfg, profile, workload)
    return DecoupledSim(cfg, profile, workload).run()
