"""The whole system in simulated time. The trainer side is the live roles themselves: one ``TrainerShard`` per
shard (receive, evict, readiness, moves, plan, retire) and the ``Leader`` (Progress, the global dispatcher,
the placement controller), whose Progress words reach each simulated rollout worker at once through
``apply_progress``, the live rollout worker's function. The rollout side is simulated engines under the live
scheduling classes (``DispatchBudget``, ``ShardRouter``, ``ConcurrencyController``, ``KVAdmission``), and the
rule is ``resolve_settings``'s, so the simulator runs the decisions the live system runs, at 8 to 128 GPUs.

Decoupled modes, one trainer step (``DecoupledSim.run``):

  1. wait     advance the engine with the earliest clock, one macro-step at a time, delivering each finished
              group (stamped with its finish version) to the shard the router picks, until every shard can
              serve exactly b/A samples (the trainer waits); shards short of samples take others' surplus
              (``TrainerView.moves``, as the live readiness exchange computes them)
  2. train    plan every shard's batch (fresh earliest deadline first, replayed up to sigma), train for the
              slowest rank's tokens while every engine runs on to the end of the step
  3. retire   first uses retire their samples; the leader publishes Progress, and with scheduler.kv_admission
              its dispatcher deals the new room by the engines' KV loads
  4. sync     every k steps: the trainer and every engine pause for the weight sync; engines admit new
              groups at the new version, sequences in flight keep their birth version (partial rollouts) and
              prefill their prompt and prefix again (the live engine resets its prefix cache)
  5. place    at sync points the placement controller (the planner) may move ranks: every engine holds what
              it has in flight, the transition costs the profile's seconds, leaving shards hand their samples
              to staying ones, the held groups are dealt to the new engines (``deal_groups``, as
              ``change_placement``) and budgets restart at this step

``sync`` mode: every GPU generates its share of the batch to completion, then every GPU trains, then syncs.

Simplifications, stated: commands and samples travel instantly; engines admit between macro-steps (a few
decode steps) rather than between single steps; a sequence at its tool is handed over at a placement change
(live, a leaving worker waits for it to come back first); one global prompt stream.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from reflow.config.job_config import JobConfig
from reflow.config.mode_settings import resolve_settings
from reflow.distributed.placement import placement_name
from reflow.modes.commands import Command, Progress, apply_progress
from reflow.modes.leader import Leader
from reflow.modes.ledger import new_ledger
from reflow.modes.trainer_shard import TrainerShard
from reflow.replay import ReplayBuffer, build_filter, build_sampler
from reflow.scheduler import DispatchBudget, PlacementPlanner, PlannerSettings
from reflow.scheduler.concurrency import (
    AdmissionRule,
    ConcurrencyController,
    ConcurrencySettings,
    KVAdmission,
    ResponseLengths,
    groups_in_flight,
)
from reflow.scheduler.dispatch import WorkerReport
from reflow.scheduler.routing import ShardRouter, deal_groups
from reflow.sim.engine import SimEngine, SimSequence
from reflow.sim.profiles import CostProfile
from reflow.sim.workload import Workload
from reflow.types import Sample, TrainerView, WorkerStats


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
    received_tokens: int = 0
    """Response tokens of the samples that arrived."""
    evicted: int = 0
    sync_s: float = 0.0
    engine_steps: int = 0
    step_sequences: int = 0
    """Sequences summed over the engine steps of the step (mean in flight = step_sequences / engine_steps)."""
    latencies: list[float] = field(default_factory=list)
    """Admission-to-finish seconds of the samples whose group finished in the step."""

    def as_row(self) -> dict:
        """The live decoupled rows' keys the placement planner reads."""
        return {
            "step": self.step, "step_time_s": self.end - self.start, "trainer_wait_s": self.wait_s,
            "received_samples": self.received, "received_response_len_mean": self.received_tokens / max(self.received, 1),
            "evicted_unused": self.evicted, "fresh_samples": self.fresh, "replayed_samples": self.replayed,
            "trainer_tokens": self.trainer_tokens, "rollout_busy_s": self.rollout_busy_s, "rollout_idle_s": self.rollout_idle_s,
        }


def summarize(records: list[StepRecord], warmup: int, transitions: list[dict]) -> dict:
    kept = [r for r in records if r.step > warmup] or records
    seconds = sum(r.end - r.start for r in kept)
    busy = sum(r.rollout_busy_s for r in kept)
    idle = sum(r.rollout_idle_s for r in kept)
    engine_steps = sum(r.engine_steps for r in kept)
    latencies = [x for r in kept for x in r.latencies]
    return {
        "mean_in_flight": sum(r.step_sequences for r in kept) / engine_steps if engine_steps else 0.0,
        "admission_to_finish_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "sync_s_per_step": sum(r.sync_s for r in kept) / max(len(kept), 1),
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


class _InstantControl:
    """The simulator's control plane: a command reaches its rollout worker at once, and is applied by the
    function the live rollout worker applies it with."""

    def __init__(self, sim: "DecoupledSim"):
        self.sim = sim

    def send(self, dst: int, command: Command) -> None:
        if not isinstance(command, Progress):
            raise TypeError(f"the simulator's leader sends only Progress, got {command!r}")
        rollout = self.sim.rollouts[dst]
        apply_progress(command, rollout.budget, rollout.router)


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
        self.shards: list[TrainerShard] = []
        self.ledger = new_ledger()  # every simulated shard's entries (the live ledger's, in one)
        self.rollouts: list[_Rollout] = []
        self.records: list[StepRecord] = []
        self.transitions: list[dict] = []
        self.received = 0  # samples delivered to the shards during the current step
        self.received_tokens = 0  # and their response tokens
        self.latencies: list[float] = []  # admission-to-finish seconds of the samples finished this step
        self.planner = (
            PlacementPlanner(PlannerSettings(
                world_size=cfg.gpus, shard_degree=cfg.shard_degree,
                replica_options=tuple(range(1, (cfg.gpus - 1) // cfg.shard_degree + 1)), sigma=self.settings.sigma,
                batch_size=cfg.batch, cooldown_steps=cfg.cooldown_steps, margin=cfg.margin, horizon_steps=cfg.horizon_steps,
                transition_cost_s=profile.transition_s, warmup_steps=cfg.warmup_steps,
            ))
            if cfg.adaptive_placement else None
        )
        self.leader = Leader(_InstantControl(self), cfg.group_size, self.planner)
        self.earliest: list[tuple[float, int]] = []  # (clock, index) of the busy engines (``_step_earliest``)
        self.evicted_at = -1  # the version the shards last evicted aged samples at
        self.engines_ever: list[SimEngine] = []  # every engine the run built (for its preemption count)
        self._enter(cfg.replicas)

    # ---- placement ---------------------------------------------------------------------

    @property
    def placement(self) -> str:
        return placement_name(self.replicas, self.cfg.shard_degree, len(self.rollouts))

    def _new_shard(self, index: int, num_rollout: int, batch_per_shard: int) -> TrainerShard:
        buffer = ReplayBuffer(
            self.settings.sigma, self.settings.delta, build_sampler("random"), build_filter("accept_all"),
            seed=self.cfg.seed + index, min_staleness=self.settings.min_staleness, anchor=self.settings.anchor,
        )
        buffer.start_version = 0
        return TrainerShard(buffer, index, num_rollout, batch_per_shard, self.ledger)

    def _enter(self, replicas: int, held: list[list[list[SimSequence]]] | None = None) -> None:
        """The roles of a placement, as ``DecoupledMode.enter`` and ``change_placement`` take them up: staying
        shards keep their samples, a leaving shard hands its buffer to the staying one of index (its index mod
        A'), every budget starts at this step, and the leader deals (or tells) the new rollout workers."""
        cfg = self.cfg
        self.replicas = replicas
        num_shards = replicas * cfg.shard_degree
        num_rollout = cfg.gpus - num_shards
        batch_per_shard = cfg.batch // num_shards
        leaving = self.shards[num_shards:]
        self.shards = self.shards[:num_shards]
        for shard in self.shards:
            shard.batch_per_shard = batch_per_shard
            shard.restart_budgets(num_rollout)
        self.shards += [self._new_shard(k, num_rollout, batch_per_shard) for k in range(len(self.shards), num_shards)]
        for shard in leaving:
            samples, draws = shard.hand_over()
            self.shards[shard.index % num_shards].accept_handover(samples, draws)
        engines = [r.engine for r in self.rollouts]
        kept = engines[len(engines) - num_rollout:] if num_rollout <= len(engines) else engines
        fresh = [SimEngine(self.profile, i) for i in range(num_rollout - len(kept))]
        self.engines_ever.extend(fresh)
        for engine in fresh:
            engine.clock = engine.paused_until = self.clock
            engine.version = self.version
        if held is not None:  # the partial rollouts: a staying engine keeps its own, a leaving one's are dealt
            first_kept = len(engines) - len(kept)
            stays = [len(fresh) + (k - first_kept) if k >= first_kept else None for k in range(len(engines))]
            new_engines = fresh + kept
            for target, dealt in enumerate(deal_groups([[len(g) for g in groups] for groups in held], stays, num_rollout)):
                new_engines[target].resume([seq for worker, k in dealt for seq in held[worker][k]])
        dealt = cfg.kv_admission  # the global dispatcher deals the room, as in the live system
        self.rollouts = [
            _Rollout(
                engine,
                DispatchBudget(self.settings.dispatch, index, num_rollout, cfg.group_size, start_step=self.steps_done, dealt=dealt),
                ShardRouter(num_shards, first=index), index, cfg, self.profile, self.workload,
            )
            for index, engine in enumerate(fresh + kept)
        ]
        dispatcher = (
            Leader.new_dispatcher(self.settings.dispatch, num_rollout, cfg.group_size, cfg.rho, self.steps_done)
            if dealt else None
        )
        self.leader.enter(list(range(num_rollout)), dispatcher)
        self._rebuild_earliest()
        self._tell_budgets()
        for rollout in self.rollouts:
            self._admit(rollout)

    def _transition(self, replicas: int) -> None:
        """As ``change_placement``: every engine holds what it has in flight (partial rollouts, which count
        against no budget afterwards), the change costs the mechanism (the profile's transition seconds), and
        the new placement's engines resume the held groups (``deal_groups``), prefilling them again."""
        start = self.clock
        held = []
        for rollout in self.rollouts:
            groups: dict[str, list[SimSequence]] = {}
            for seq in rollout.engine.hold_all():
                seq.origin = -1
                groups.setdefault(seq.group, []).append(seq)
            held.append(list(groups.values()))
        self.clock = max([self.clock] + [r.engine.clock for r in self.rollouts]) + self.profile.transition_s
        for rollout in self.rollouts:
            rollout.engine.idle_s += self.clock - rollout.engine.clock
            rollout.engine.clock = self.clock
        old = self.placement
        self._enter(replicas, held)
        event = {"after_step": self.steps_done, "transition": f"{old} -> {self.placement}", "transition_s": self.clock - start}
        self.transitions.append(event)
        self.leader.placement_rows.append(event)

    # ---- rollout side --------------------------------------------------------------------

    def _admit(self, rollout: _Rollout) -> None:
        engine = rollout.engine
        was_idle = not engine.num_active
        self._admit_group(rollout)
        if was_idle and engine.num_active:  # an idle engine that gets work enters the heap of busy engines
            heapq.heappush(self.earliest, (max(engine.clock, engine.paused_until), rollout.index))

    def _admit_group(self, rollout: _Rollout) -> None:
        """Start whole groups while the budget has room and the admission rule lets the next one in."""
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
                    tool_latency_s=self.workload.tool_latency_s, admitted_at=engine.clock,
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
            self.latencies.extend(rollout.engine.clock - member.admitted_at for member in members)
            samples = []
            for member in members:
                self.tokens[member.uid] = member.prompt_tokens + member.generated
                samples.append(Sample(
                    uid=member.uid, draw=member.draw, group_id=member.group, prompt_ids=[], output_ids=[], logprobs=[],
                    versions=[member.birth_version], reward=0.5, origin=member.origin, advantage=1.0,
                    finish_version=rollout.engine.version,
                ))
            # bound to a shard on arrival: the router sees the shards' counts exactly here (Progress, instantly)
            rollout.router.update([shard.buffer.num_unused for shard in self.shards])
            self.shards[rollout.router.choose(len(samples))].accept_group(samples, self.version)
            self.received += len(samples)
            self.received_tokens += sum(member.generated for member in members)

    def _step_earliest(self) -> float | None:
        """One macro-step of the busy engine with the earliest clock (ties: the lowest index); returns that
        engine's clock after it (None if no engine has work).

        ``self.earliest`` is a lazy heap of (clock, index): every engine with work has an entry, whose clock is
        at most its actual one (clocks only advance). The top is corrected until it is exact, so it is the
        earliest busy engine."""
        heap = self.earliest
        while heap:
            key, index = heap[0]
            engine = self.rollouts[index].engine
            if not engine.num_active:
                heapq.heappop(heap)
            elif max(engine.clock, engine.paused_until) != key:
                heapq.heapreplace(heap, (max(engine.clock, engine.paused_until), index))
            else:
                break
        else:
            return None
        rollout = self.rollouts[index]
        self._deliver(rollout, rollout.engine.step(float("inf")) or [])
        self._admit(rollout)
        heapq.heapreplace(heap, (max(rollout.engine.clock, rollout.engine.paused_until), index))
        return rollout.engine.clock

    def _rebuild_earliest(self) -> None:
        self.earliest = [(max(r.engine.clock, r.engine.paused_until), r.index) for r in self.rollouts if r.engine.num_active]
        heapq.heapify(self.earliest)

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

    def _view(self) -> TrainerView:
        """The readiness exchange, in process: every shard's report, combined as the gloo exchange does."""
        return TrainerView.combine([shard.readiness(self.version) for shard in self.shards])

    def _tell_budgets(self) -> None:
        """The leader's Progress (reports read exactly, commands delivered at once: ``_InstantControl``)."""
        if self.leader.dispatcher is not None:
            for rollout in self.rollouts:
                self.leader.receive_stats(rollout.index, WorkerStats(load=rollout.report()))
            self.leader.rollout_window.clear()  # (the simulator keeps its own busy and idle seconds)
        self.leader.publish(self.steps_done, self._view())

    def _ready(self) -> bool:
        """The trainer's wait loop (``DecoupledMode._wait_for_batch``) with instant moves: evict what aged, then
        move until no move is due, and report whether every shard can serve exactly b/A. While the shards hold
        fewer unused samples than their batches need together, no shard set can be ready: the full check waits
        for that (the version is fixed while the trainer waits, so nothing ages meanwhile)."""
        if self.evicted_at != self.version:  # (a group that arrives stale is retired on arrival)
            for shard in self.shards:
                shard.evict_stale(self.version, "aged")
            self.evicted_at = self.version
        per_shard = self.shards[0].batch_per_shard
        if sum(shard.buffer.num_unused for shard in self.shards) < sum(shard.buffer.need(per_shard) for shard in self.shards):
            return False
        while True:
            view = self._view()
            moves = view.moves(self.shards[0].batch_per_shard)
            if not moves:
                return view.all_ready
            for shard in self.shards:
                for receiver, samples in shard.donate(moves, self.version):
                    self.shards[receiver].accept_moved(samples)

    def run(self) -> dict:
        cfg, profile = self.cfg, self.profile
        while self.steps_done < cfg.steps:
            step_start = self.clock
            busy0 = sum(r.engine.busy_s for r in self.rollouts)
            idle0 = sum(r.engine.idle_s for r in self.rollouts)
            self.received = self.received_tokens = 0
            self.latencies = []
            steps0 = sum(r.engine.engine_steps for r in self.rollouts)
            sequences0 = sum(r.engine.step_sequences for r in self.rollouts)
            sync_s = 0.0
            evicted_before = len(self.ledger["evicted_unused"])
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
            plans = [shard.plan(self.version) for shard in self.shards]
            rank_tokens = [sum(self.tokens[s.uid] for s in plan.fresh + plan.replayed) for plan in plans]
            staleness = [0] * (self.settings.delta + 1)
            for shard, plan in zip(self.shards, plans):
                for sample in plan.fresh + plan.replayed:
                    staleness[shard.buffer.staleness(sample, self.version)] += 1
            train_end = ready + profile.train_overhead_s + max(rank_tokens) * profile.train_token_s
            if len(self.shards) > 1:
                train_end += profile.train_collective_s
            self._run_engines_to(train_end)
            self.clock = train_end
            # 3. retire and tell the budgets
            for shard, plan in zip(self.shards, plans):
                shard.retire_trained(plan)
                shard.take_window()
            self.version += 1
            self.steps_done += 1
            # 4. weight sync
            if self.version % self.settings.interval == 0:
                for shard in self.shards:
                    shard.evict_stale(self.version, "at_sync")
                for rollout in self.rollouts:
                    rollout.engine.paused_until = max(rollout.engine.clock, self.clock) + profile.weight_sync_s
                    rollout.engine.version = self.version
                    rollout.engine.reload_weights()
                self.clock += profile.weight_sync_s
                sync_s = profile.weight_sync_s
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
                placement=self.placement, staleness=staleness, received_tokens=self.received_tokens,
                evicted=len(self.ledger["evicted_unused"]) - evicted_before, sync_s=sync_s,
                engine_steps=sum(r.engine.engine_steps for r in self.rollouts) - steps0,
                step_sequences=sum(r.engine.step_sequences for r in self.rollouts) - sequences0, latencies=self.latencies,
            )
            self.records.append(record)
            self.leader.placement_rows.append(record.as_row())
            # 5. placement, at sync points
            if self.planner is not None and self.version % self.settings.interval == 0 and self.steps_done < cfg.steps:
                decision = self.leader.decide_placement(self.steps_done, self.replicas)
                if decision.target is not None:
                    self._transition(decision.target)
                    self.transitions[-1]["reason"] = decision.reason
        result = summarize(self.records, cfg.warmup_steps, self.transitions)
        evicted = len(self.ledger["evicted_unused"])
        result["evicted_unused"] = evicted
        trained_fresh = sum(r.fresh for r in self.records)
        result["evicted_fraction"] = evicted / max(evicted + trained_fresh, 1)
        result["moved_between_shards"] = len(self.ledger["moved_in"])
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
            step=step, start=start, end=clock, wait_s=generated - start, trainer_tokens=sum(tokens), sync_s=profile.weight_sync_s,
            received=cfg.batch, fresh=cfg.batch, replayed=0,
            rollout_busy_s=sum(e.busy_s for e in engines) - busy0, rollout_idle_s=sum(e.idle_s for e in engines) - idle0,
            placement=placement_name(1, cfg.gpus, 0),
        ))
    return summarize(records, cfg.warmup_steps, [])


def simulate(cfg: SimConfig, profile: CostProfile, workload: Workload) -> dict:
    if cfg.mode == "sync":
        return simulate_sync(cfg, profile, workload)
    return DecoupledSim(cfg, profile, workload).run()


def simulate_job(job: tuple[SimConfig, CostProfile, Workload]) -> dict:
    """``simulate`` of one (config, profile, workload): what a process pool's worker runs."""
    return simulate(*job)
