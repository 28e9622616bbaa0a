"""The whole system in simulated time, run by the live roles themselves: one ``TrainerShard`` per shard
(receive, evict, readiness, moves, plan, retire) under the live ``TrainerRole`` (its wait-loop poll and its
step, over in-process protocols: ``InProcessExchange``, ``SimMover``, ``SimTrainer``, ``SimPublisher``), the
``Leader`` (Progress, the global dispatcher, the
placement controller) and one live ``RolloutWorker`` per rollout rank (commands, admission gate, dispatch
budget, router, group assembly, partial rollouts at syncs and placement changes), over simulated engines
(``reflow.sim.engine.SimEngine``, a live ``Engine``) and an in-process transport, on a simulated clock. What
is simulated is the engines' and the trainer's time, the workload (``SimGroups``: response lengths drawn from
it) and the rewards (``SimScorer``: which groups have reward signal, for dynamic sampling); every decision is
the live code's, with ``resolve_settings``'s rule.

Decoupled modes, one trainer step (``DecoupledSim.run``):

  1. wait     tick the rollout worker whose engine clock is earliest (one engine step, admission, commands),
              delivering each finished group to the shard its router picks, until every shard can serve
              exactly b/A samples (the trainer waits); every arrival runs the readiness exchange: the
              leader's Progress goes out and shards short of samples take others' surplus
              (``TrainerView.moves``)
  2. train    plan every shard's batch (fresh earliest deadline first, replayed up to sigma), train for the
              slowest rank's tokens times a measured step-to-step ratio plus the profile's fixed costs, while
              every worker runs on to the end of it
  3. retire   first uses retire their samples
  4. sync     every k steps: SyncWeights to every worker, which takes its first-token steps (one_step_off) and
              joins; the sync ends weight_sync_s after the trainer joined, or with the last worker to join, and
              each worker's reload (worker_sync_s) holds its requests a little longer; those holding KV then
              prefill prompt and prefix again (a reload resets the prefix cache), queued ones wait on
  5. progress the leader's Progress (with scheduler.kv_admission its dispatcher deals the new room by the
              workers' reported KV loads)
  6. place    at sync points the placement controller (the planner) may move ranks: Transition to every
              worker, which holds its partial rollouts; the change costs the profile's seconds, and every rank
              runs the live ``change_placement`` (leaving shards hand their samples to staying ones, the held
              groups are dealt to the new workers) over in-process links, then takes up its roles as
              ``DecoupledMode.enter`` does (``take_up_shard``; budgets restart at this step)

``sync`` mode: every GPU generates its share of the batch to completion, then every GPU trains, then syncs.

Simplifications, stated: commands and samples travel instantly; an engine step is a macro-step of a few
decode steps (admission runs between them); a sequence at its tool holds its KV blocks and is handed over
with the others at a placement change; one global prompt stream.
"""

from __future__ import annotations

import gc
import heapq
import random
import time
from collections import deque
from dataclasses import dataclass, field, replace

from reflow.algorithms.shaping import MAX_EXTRA_BATCHES
from reflow.config.job_config import ReplaySection, RolloutSection, SchedulerSection, TrainingSection, WeightSyncSection
from reflow.config.mode_settings import mode_settings
from reflow.distributed.placement import Placement, build_placement, placement_name
from reflow.modes.leader import Leader
from reflow.modes.ledger import filtered_uids, new_ledger
from reflow.modes.rollout_worker import RolloutWorker
from reflow.modes.trainer_role import Poll, TrainerRole
from reflow.modes.trainer_shard import TrainerShard, new_shard
from reflow.modes.transition import ChangePlan, RankState, TrainerClock, change_placement, take_up_shard
from reflow.replay import build_filter, build_sampler
from reflow.replay.buffer import BatchPlan
from reflow.rollout.admission import AdmissionGate
from reflow.rollout.request import Request
from reflow.rollout.turns import TurnDriver
from reflow.scheduler import DispatchBudget, build_controller
from reflow.sim.engine import SimEngine, SimTrajectory
from reflow.sim.profiles import CostProfile
from reflow.sim.workload import Workload
from reflow.types import (
    Command,
    EvalShare,
    GroupDone,
    Handover,
    HeldGroup,
    InProcessExchange,
    ResizeReport,
    Sample,
    SyncWeights,
    Transition,
    WorkerStats,
)


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
    cooldown_steps: int = SchedulerSection.cooldown_steps
    margin: float = SchedulerSection.margin
    horizon_steps: int = SchedulerSection.horizon_steps
    warmup_steps: int = 3
    """Steps left out of the summary and of the planner's measurements."""
    planner_memory_steps: int = SchedulerSection.planner_memory_steps
    """Each placement's own rates (the planner's step 7), as live."""
    planner_explore_budget: float = SchedulerSection.planner_explore_budget
    """Trials of unmeasured placements (the planner's step 8), as live."""
    strict_window: bool = False
    """replay.strict_window: reflow's narrower window (nothing outlives its bound unused)."""
    dynamic_sampling: bool = False
    """reward.dynamic_sampling: groups without reward signal (``Workload.no_signal_fraction``) are filtered, in
    the decoupled modes by the live shards, in sync by extra rounds of generation (as ``SyncMode``)."""
    seed: int = 0
    micro_batch_size: int = 0
    """training.micro_batch_size: rows a forward/backward pass (0: not known; a profile fitted on the passes' token
    slots then charges plain tokens)."""
    micro_batch_tokens: int = 0
    """training.micro_batch_tokens (``plan_micro_batches``)."""
    macro_steps: int = 32
    """Decode steps an engine step may run at most (admission and commands run between engine steps): 1 is the
    live engine's granularity; more is faster to simulate."""
    macro_s: float = 0.0
    """Seconds of decode a macro-step fills at least, in more than ``macro_steps`` steps where a small batch's
    steps are short (``SimEngine.macro_s``; 0: ``macro_steps`` only)."""
    report_interval_s: float = 1.0
    """Seconds between a worker's reports to the leader (``RolloutWorker.report_interval_s``): the live 1 s, or
    longer where the reports would otherwise come after almost every macro-step."""

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size

    def sections(self, profile: CostProfile, workload: Workload) -> "SimSections":
        """The live config sections this simulation stands for: what the live roles read."""
        return SimSections(
            training=TrainingSection(mode=self.mode, prompts_per_step=self.prompts_per_step, group_size=self.group_size),
            replay=ReplaySection(sigma=self.sigma, tau=self.tau, delta=self.delta, strict_window=self.strict_window),
            weight_sync=WeightSyncSection(interval=self.interval),
            rollout=RolloutSection(b_max=self.b_max, max_num_seqs=profile.max_num_seqs, max_new_tokens=workload.max_tokens),
            scheduler=SchedulerSection(
                adaptive_concurrency=self.adaptive_concurrency, kv_admission=self.kv_admission, rho=self.rho,
                response_percentile=self.response_percentile, adaptive_placement=self.adaptive_placement,
                cooldown_steps=self.cooldown_steps, margin=self.margin, horizon_steps=self.horizon_steps,
                transition_cost_s=profile.transition_s, planner_warmup_steps=self.warmup_steps,
                planner_memory_steps=self.planner_memory_steps, planner_explore_budget=self.planner_explore_budget,
            ),
        )

    def __post_init__(self):
        if self.dynamic_sampling and self.mode == "one_step_off":
            raise ValueError("dynamic_sampling: one_step_off trains exactly what started one version back (refused live too)")


@dataclass(frozen=True)
class SimSections:
    training: TrainingSection
    replay: ReplaySection
    weight_sync: WeightSyncSection
    rollout: RolloutSection
    scheduler: SchedulerSection


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
    """Samples evicted unused for staleness (the filtered ones are ``filtered``)."""
    filtered: int = 0
    """Samples dynamic sampling dropped: their group had no reward signal."""
    sync_s: float = 0.0
    engine_steps: int = 0
    step_sequences: int = 0
    """Sequences summed over the engine steps of the step (mean in flight = step_sequences / engine_steps)."""
    latencies: list[float] = field(default_factory=list)
    """Admission-to-finish seconds of the samples whose group finished in the step."""
    loss_tokens: float = 0.0
    """Response tokens trained, a replayed sample's at tau (the live rows' ``loss_tokens``; sync: every response
    token)."""

    def as_row(self) -> dict:
        """The live decoupled rows' keys the placement planner reads."""
        return {
            "step": self.step, "step_time_s": self.end - self.start, "trainer_wait_s": self.wait_s,
            "received_samples": self.received, "received_response_len_mean": self.received_tokens / max(self.received, 1),
            "evicted_unused": self.evicted + self.filtered, "fresh_samples": self.fresh, "replayed_samples": self.replayed,
            "trainer_tokens": self.trainer_tokens, "rollout_busy_s": self.rollout_busy_s, "rollout_idle_s": self.rollout_idle_s,
        }


def _mean_share(parts: list[tuple[float, float]]) -> float:
    """The mean of part / whole over (part, whole) pairs whose whole is not zero."""
    shares = [part / whole for part, whole in parts if whole > 0]
    return sum(shares) / len(shares) if shares else 0.0


def summarize(records: list[StepRecord], warmup: int, transitions: list[dict]) -> dict:
    kept = [r for r in records if r.step > warmup] or records
    seconds = sum(r.end - r.start for r in kept)
    busy = sum(r.rollout_busy_s for r in kept)
    idle = sum(r.rollout_idle_s for r in kept)
    engine_steps = sum(r.engine_steps for r in kept)
    latencies = [x for r in kept for x in r.latencies]
    received = sum(r.received for r in kept)
    return {
        "filtered_fraction": sum(r.filtered for r in kept) / max(received, 1),
        "mean_in_flight": sum(r.step_sequences for r in kept) / engine_steps if engine_steps else 0.0,
        "admission_to_finish_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "sync_s_per_step": sum(r.sync_s for r in kept) / max(len(kept), 1),
        "tokens_per_s": sum(r.trainer_tokens for r in kept) / max(seconds, 1e-9),
        "fresh_samples_per_s": sum(r.fresh for r in kept) / max(seconds, 1e-9),
        "replay_fraction": sum(r.replayed for r in kept) / max(sum(r.fresh + r.replayed for r in kept), 1),
        "loss_tokens_per_s": sum(r.loss_tokens for r in kept) / max(seconds, 1e-9),
        # as the live rows count it (waiting for data and stalling in a weight sync are both trainer idle time),
        # and as the modes benchmark summarizes them: the mean over the steps of each step's share (a long step's
        # share counts as much as a short one's; on the rollout-bound bench's async run the time-weighted share
        # of waiting was 0.54 and the mean share 0.46)
        "trainer_idle_ratio": _mean_share([(r.wait_s + r.sync_s, r.end - r.start) for r in kept]),
        "trainer_wait_ratio": _mean_share([(r.wait_s, r.end - r.start) for r in kept]),
        "sync_stall_ratio": _mean_share([(r.sync_s, r.end - r.start) for r in kept]),
        "rollout_idle_ratio": _mean_share([(r.rollout_idle_s, r.rollout_busy_s + r.rollout_idle_s) for r in kept]),
        "rollout_idle_time_share": idle / max(busy + idle, 1e-9),
        "steps": len(records),
        "seconds": records[-1].end if records else 0.0,
        "step_time_s": seconds / max(len(kept), 1),
        "trained_per_step": [r.fresh + r.replayed for r in records],
        "timeline": [{"step": r.step, "end_s": round(r.end, 3), "placement": r.placement} for r in records],
        "transitions": transitions,
    }


LEADER = -1
"""The leader's address on the simulated data plane (shards are addressed by their index)."""


class SimGroups:
    """The simulated workers' ``GroupSource``: one global prompt stream, and G requests per draw whose response
    lengths (and tool calls) the workload draws at the trainer's current step."""

    def __init__(self, sim: "DecoupledSim"):
        self.sim = sim

    def peek(self) -> int:
        return self.sim.draws

    def take(self) -> int:
        draw = self.sim.draws
        self.sim.draws += 1
        return draw

    def requests(self, draw: int, version: int) -> list[Request]:
        sim = self.sim
        workload, group = sim.workload, f"g{draw}"
        prompt_tokens, lengths = workload.draw_group(sim.rng, sim.steps_done, sim.cfg.group_size)
        prompt = [0] * prompt_tokens  # shared by the group, as its prompt blocks are
        requests = []
        for k, target in enumerate(lengths):
            turns = workload.tool_turns
            points = [target * (t + 1) // (turns + 1) for t in range(turns)] if turns else []
            requests.append(Request(
                request_id=f"{group}/{k}", prompt_ids=prompt, max_tokens=workload.max_tokens, seed=k,
                meta={"group": group, "draw": draw,
                      "sim": SimTrajectory(target, points, workload.tool_latency_s)},
            ))
        return requests


class SimScorer:
    """The simulated ``GroupScorer``: a group with signal gets rewards 1, 0, ..., 0 and one without all 0
    (``Workload.has_signal``); they matter only to dynamic sampling (the replay filter accepts all)."""

    def __init__(self, workload: Workload, seed: int):
        self.workload, self.seed = workload, seed

    def score(self, members: list[Request]) -> list[Sample]:
        signal = self.workload.has_signal(self.seed, members[0].meta["draw"])
        return [
            Sample(uid=req.request_id, draw=req.meta["draw"], group_id=req.meta["group"], prompt_ids=req.prompt_ids,
                   output_ids=req.output_ids, logprobs=req.logprobs, versions=req.versions,
                   reward=float(signal and k == 0), finish_reason=req.finish_reason, advantage=1.0)
            for k, req in enumerate(members)
        ]


class SimWeightSync:
    """A simulated worker's side of the weight sync: it loads the version and records when it joined."""

    def __init__(self):
        self.joined: list[float] = []

    def sync(self, trainer, engine: SimEngine, version: int) -> dict:
        self.joined.append(engine.clock)
        engine.load_weights((), version)
        return {}


class SimControl:
    """The in-process control plane: the leader's ``CommandSink``, and each worker's ``CommandSource`` (a queue,
    in the order sent). A command to an idle worker wakes it at the simulated time it was sent."""

    def __init__(self, sim: "DecoupledSim"):
        self.sim = sim
        self.queues: dict[int, deque] = {}

    def send(self, dst: int, command: Command) -> None:
        self.queues[dst].append(command)
        self.sim.wake(dst)

    def source(self, index: int) -> "WorkerControl":
        self.queues[index] = deque()
        return WorkerControl(self.queues[index])


class WorkerControl:
    """One simulated worker's ``CommandSource``: nothing blocks, an empty queue answers at once."""

    leader = LEADER

    def __init__(self, queue: deque):
        self.queue = queue

    def poll(self) -> list[Command]:
        commands = list(self.queue)
        self.queue.clear()
        return commands

    def wait(self, timeout: float | None = None) -> Command | None:
        return self.queue.popleft() if self.queue else None


class SimOutbox:
    """One simulated worker's ``DataSink``: a group reaches its shard at once, reports reach the leader."""

    def __init__(self, sim: "DecoupledSim", index: int):
        self.sim, self.index = sim, index

    def put(self, dst: int, body) -> None:
        if isinstance(body, GroupDone):
            self.sim.deliver(dst, body.samples)
        elif isinstance(body, WorkerStats):
            self.sim.leader.receive_stats(self.index, body)
        elif isinstance(body, EvalShare):
            self.sim.leader.evaluations.add(body)
        else:
            raise TypeError(f"a simulated worker sent {body!r} to {dst}")


class SimMover:
    """The simulator's ``SampleMover``: a moved sample reaches its shard at once."""

    def __init__(self, sim: "DecoupledSim"):
        self.sim = sim

    def send(self, receiver: int, samples: list[Sample]) -> None:
        self.sim.shards[receiver].accept_moved(samples)


class SimTrainer:
    """The simulator's ``TrainerBackend``: the step lasts the slowest rank's tokens times a measured step-to-step
    ratio plus the profile's fixed costs, while every worker runs on to its end."""

    def __init__(self, sim: "DecoupledSim"):
        self.sim = sim

    def resize(self, replicas: int, *, bucket_bytes: int | None) -> ResizeReport:
        """``PolicyTrainer.resize`` on one rank: the direction of the change (its time is the profile's
        ``transition_s``, charged once for the whole change; no bytes are simulated)."""
        old = self.sim.layout.replicate_degree
        return ResizeReport(source=f"T{old}", target=f"T{replicas}", direction=ResizeReport.direction_of(old, replicas))

    def train(self, plans: list[BatchPlan], version: int) -> dict:
        sim, profile = self.sim, self.sim.profile
        rows = [[len(s.prompt_ids) + len(s.output_ids) for s in plan.fresh + plan.replayed] for plan in plans]
        rank_tokens = [sum(r) for r in rows]
        charged = max(profile.charged_tokens(r, sim.cfg.micro_batch_size, sim.cfg.micro_batch_tokens) for r in rows)
        train_end = sim.clock + profile.step_fixed_s + profile.train_seconds(charged, len(plans), sim.train_rng)
        sim._run_workers_to(train_end)
        sim.clock = train_end
        return {"rank_tokens": rank_tokens}


class SimPublisher:
    """The simulator's ``WeightPublisher``: ``DecoupledSim._sync``."""

    def __init__(self, sim: "DecoupledSim"):
        self.sim = sim

    def publish(self, version: int) -> None:
        self.sim.version = version  # (what the workers deliver during the sync is checked against it)
        self.sim.sync_s = self.sim._sync()


class SimPlacementLinks:
    """The in-process ``PlacementLinks`` of ``DecoupledSim._change_every_rank``, which calls ``change_placement``
    for one rank after another (``rank``): samples travel instantly, so every FLUSH finds nothing behind it and
    must precede every drain; a handover waits in ``handovers`` until the new placement's shards exist; every
    rank's clock is the one simulated clock, and every rank's all-gather value is known before the first call
    (``offered``: a rank that offers anything else is a fault)."""

    def __init__(self, clock: TrainerClock, offered: list):
        self.clock, self.offered = clock, offered
        self.rank = 0
        self.flushed: set[int] = set()
        self.handovers: list[tuple[int, Handover]] = []

    def flush(self, trainer_ranks: list[int]) -> None:
        self.flushed.add(self.rank)

    def drain(self, rollout_workers: list[int]) -> None:
        missing = sorted(set(rollout_workers) - self.flushed)
        if missing:
            raise RuntimeError(f"simulated rank {self.rank} drained before rollout workers {missing} flushed")

    def hand_over(self, heir_rank: int, handover: Handover) -> None:
        self.handovers.append((heir_rank, handover))

    def broadcast(self, values: list[int]) -> list[int]:
        clock = self.clock
        return [clock.step, clock.version, clock.steps_done, clock.drawn]

    def all_gather(self, value) -> list:
        if value != self.offered[self.rank]:
            raise RuntimeError(f"simulated rank {self.rank} offered {value!r}, not {self.offered[self.rank]!r}")
        return self.offered


class DecoupledSim:
    def __init__(self, cfg: SimConfig, profile: CostProfile, workload: Workload):
        self.cfg, self.profile, self.workload = cfg, profile, workload
        self.sections = cfg.sections(profile, workload)
        s = self.sections
        self.settings = mode_settings(s.training, s.replay, s.weight_sync, s.rollout)
        self.rng = random.Random(cfg.seed)
        self.train_rng = random.Random(cfg.seed + 1)  # the train steps' measured noise, apart from the workload's draws
        self.version = 0
        self.steps_done = 0
        self.clock = 0.0
        self.draws = 0
        self.shards: list[TrainerShard] = []
        self.ledger = new_ledger()  # every simulated shard's entries (the live ledger's, in one)
        self.engines: list[SimEngine] = []
        self.workers: list[RolloutWorker] = []
        self.control = SimControl(self)
        self.weight_sync = SimWeightSync()
        self.records: list[StepRecord] = []
        self.transitions: list[dict] = []
        self.received = 0  # samples delivered to the shards during the current step
        self.received_tokens = 0  # and their response tokens
        self.latencies: list[float] = []  # admission-to-finish seconds of the samples finished this step
        self._sent_seen: list[int] = []  # per worker: its ledger's "sent" entries already counted
        self.planner = build_controller(  # the live run's planner, from the same [scheduler] section
            [], s.scheduler, cfg.gpus, cfg.shard_degree, tuple(range(1, (cfg.gpus - 1) // cfg.shard_degree + 1)),
            self.settings.sigma, cfg.batch,
        )
        self.leader = Leader(self.control, cfg.group_size, self.planner)
        self.runnable: list[tuple[float, int]] = []  # lazy heap of (engine clock, worker index): ``_tick_earliest``
        self.in_heap: set[int] = set()  # the workers with an entry in it
        self.sync_s = 0.0  # the latest weight sync's trainer seconds (``SimPublisher``)
        self.engines_ever: list[SimEngine] = []  # every engine the run built (for its preemption count)
        self.layout: Placement | None = None
        self._enter(build_placement(cfg.gpus, cfg.replicas, cfg.shard_degree, cfg.gpus - cfg.replicas * cfg.shard_degree))

    # ---- placement ---------------------------------------------------------------------

    @property
    def placement(self) -> str:
        return self.layout.name

    def _new_shard(self, index: int, num_rollout: int, batch_per_shard: int) -> TrainerShard:
        return new_shard(
            self.settings, index, num_rollout, batch_per_shard, self.ledger, sampler=build_sampler("random"),
            replay_filter=build_filter("accept_all"), seed=self.cfg.seed + index, start_version=0,
            dynamic_sampling=self.cfg.dynamic_sampling,
        )

    def _enter(self, layout: Placement, kept: dict[int, TrainerShard] | None = None,
               carried: list[list[HeldGroup]] | None = None, handovers: list[tuple[int, Handover]] = ()) -> None:
        """Every rank's roles in a placement, as ``DecoupledMode.enter`` takes them up: each trainer rank's shard
        (``take_up_shard``: the one it ``kept`` through a change, or a new one), every budget starting at this
        step; then the buffers handed over arrive (the live data plane delivers them after the change), each
        rollout rank's worker resumes its ``carried`` groups, and the leader deals (or tells) the new workers."""
        cfg, kept = self.cfg, kept or {}
        # a rank that generates keeps its engine; one that joins the rollout gets a new engine, awake now
        engines = dict(zip(self.layout.rollout_workers, self.engines)) if self.layout is not None else {}
        self.layout = layout
        self.replicas = layout.replicate_degree
        num_shards, num_rollout = layout.num_trainer_ranks, layout.num_rollout_ranks
        batch_per_shard = cfg.batch // num_shards
        self.shards = [
            take_up_shard(kept.get(rank), layout, rank, batch_per_shard,
                          lambda k=k: self._new_shard(k, num_rollout, batch_per_shard))
            for k, rank in enumerate(layout.trainer_ranks)
        ]
        for heir_rank, handover in handovers:
            self.shards[layout.trainer_ranks.index(heir_rank)].accept_handover(handover.samples, handover.draws)
        self.engines = []
        for rank in layout.rollout_workers:
            if rank not in engines:
                engines[rank] = SimEngine(self.profile, len(self.engines_ever), cfg.macro_steps, cfg.macro_s)
                engines[rank].clock, engines[rank].version = self.clock, self.version
                self.engines_ever.append(engines[rank])
            self.engines.append(engines[rank])
        carried = carried or [[] for _ in range(num_rollout)]
        dealt_dispatch = cfg.kv_admission  # the global dispatcher deals the room, as in the live system
        self.workers = [
            self._new_worker(index, engine, num_rollout, num_shards, carried[index], dealt_dispatch)
            for index, engine in enumerate(self.engines)
        ]
        self._sent_seen = [0] * num_rollout
        dispatcher = Leader.new_dispatcher(
            self.settings.dispatch, num_rollout, cfg.group_size, cfg.rho, self.steps_done, dealt=dealt_dispatch,
        )
        self.leader.enter(list(range(num_rollout)), dispatcher)
        self.runnable, self.in_heap = [], set()
        self.role = TrainerRole(
            self.shards, self.settings.interval, InProcessExchange(), SimMover(self), SimTrainer(self),
            SimPublisher(self), board=self.leader,
        )
        for worker in self.workers:
            worker.start()
        self.role.view(self.version, self.steps_done)  # (the leader's Progress wakes every worker)

    def _new_worker(self, index: int, engine: SimEngine, num_rollout: int, num_shards: int, carried: list[HeldGroup],
                    dealt_dispatch: bool) -> RolloutWorker:
        """A live ``RolloutWorker`` over a simulated engine, its turns (single-turn: the engine models tool turns)
        and gate on the engine's clock, and the in-process planes."""
        cfg, clock, turns = self.cfg, self._clock_of(engine), TurnDriver(engine, None, None)
        return RolloutWorker(
            engine, turns, SimGroups(self), SimScorer(self.workload, cfg.seed), self.weight_sync,
            self.control.source(index), SimOutbox(self, index),
            DispatchBudget(self.settings.dispatch, index, num_rollout, cfg.group_size, start_step=self.steps_done,
                           dealt=dealt_dispatch),
            AdmissionGate(self.sections.scheduler, self.sections.rollout, engine, cfg.group_size, turns, clock=clock),
            index, list(range(num_shards)), carried=carried, clock=clock, report_interval_s=cfg.report_interval_s,
            first_tokens_before_sync=self.settings.first_tokens_before_sync,
        )

    @staticmethod
    def _clock_of(engine: SimEngine):
        return lambda: engine.clock

    def _transition(self, replicas: int) -> None:
        """A placement change: Transition to every worker, which holds what it has in flight (partial rollouts,
        which count against no budget afterwards); then every rank runs the live ``change_placement`` over the
        in-process ``SimPlacementLinks``, the change costing the mechanism (the profile's transition seconds), and
        takes up its roles in the new placement, whose workers resume the held groups first."""
        start = self.clock
        held = []
        for index, worker in enumerate(self.workers):
            ended = self._command_now(index, Transition(replicas))
            if not isinstance(ended, Transition):
                raise RuntimeError(f"simulated worker {index} did not leave at a placement change: {ended!r}")
            held.append(worker.carried_out)
        self._collect_latencies()
        self.clock = max([self.clock] + [engine.clock for engine in self.engines]) + self.profile.transition_s
        for engine in self.engines:
            engine.wait_until(self.clock)
        plan = ChangePlan.to(self.layout, replicas)
        kept, carried, handovers = self._change_every_rank(plan, held)
        self._enter(plan.new, kept, carried, handovers)
        event = {
            "after_step": self.steps_done, "transition": f"{plan.old.name} -> {plan.new.name}",
            "transition_s": self.clock - start,
        }
        self.transitions.append(event)
        self.leader.placement_rows.append(event)

    def _change_every_rank(self, plan: ChangePlan, held: list[list[HeldGroup]]):
        """``change_placement`` on every rank, rollout workers first (their FLUSH precedes every drain): returns
        the shards the new trainer ranks kept (by rank), the held groups dealt to the new workers (by index) and
        the buffers handed over, in the order sent."""
        old, new = plan.old, plan.new
        clock = TrainerClock(self.steps_done, self.version, self.steps_done, self.draws)
        # what every rank gives the all-gather (each worker's prompt share: none, the workers draw from one stream)
        offered = [None] * old.world_size
        for index, rank in enumerate(old.rollout_workers):
            offered[rank] = (None, held[index])
        links = SimPlacementLinks(clock, offered)
        trainer = SimTrainer(self)
        kept: dict[int, TrainerShard] = {}
        carried: list[list[HeldGroup]] = [[] for _ in new.rollout_workers]
        worker_of = {rank: index for index, rank in enumerate(old.rollout_workers)}
        for rank in [*old.rollout_workers, *(r for r in range(old.world_size) if r not in worker_of)]:
            links.rank = rank
            worker = worker_of.get(rank)
            shard = self.shards[old.trainer_ranks.index(rank)] if old.is_trainer(rank) else None
            engine, mine = (self.engines[worker], held[worker]) if worker is not None else (None, [])
            before = RankState(clock, shard, [None] * len(old.rollout_workers), mine)
            after, _ = change_placement(plan, rank, before, links, engine, trainer, bucket_bytes=0)
            if after.shard is not None:
                kept[rank] = after.shard
            if rank in new.rollout_workers:
                carried[new.rollout_workers.index(rank)] = after.carried
        return kept, carried, links.handovers

    # ---- the rollout side: workers ticked in simulated time -------------------------------------

    def wake(self, index: int) -> None:
        """A command reached worker ``index``: an idle engine waits no longer than now, and the worker runs."""
        engine = self.engines[index]
        if not engine.num_active:
            engine.wait_until(self.clock)
        if index not in self.in_heap:
            self.in_heap.add(index)
            heapq.heappush(self.runnable, (engine.clock, index))

    def _command_now(self, index: int, command: Command) -> Command | None:
        """A collective command (SyncWeights, Transition): worker ``index`` takes it, behind what was queued before
        it, at once; returns the command that ended the worker, if one did."""
        self.control.queues[index].append(command)
        return self.workers[index].take_commands()

    def _is_runnable(self, index: int) -> bool:
        worker = self.workers[index]
        return bool(worker.turns.num_active or worker.commands or self.control.queues[index])

    def _tick(self, index: int) -> None:
        ended = self.workers[index].tick()
        if ended is not None:
            raise RuntimeError(f"simulated worker {index} ended outside a placement change: {ended!r}")

    def _tick_earliest(self) -> float | None:
        """One tick of the runnable worker whose engine clock is earliest (ties: the lowest index); returns that
        clock after it (None if no worker can run).

        ``self.runnable`` is a lazy heap of (clock, index): every runnable worker has an entry, whose clock is at
        most its engine's actual one (clocks only advance). The top is corrected until it is exact."""
        heap = self.runnable
        while heap:
            key, index = heap[0]
            engine = self.engines[index]
            if not self._is_runnable(index):
                heapq.heappop(heap)
                self.in_heap.discard(index)
            elif engine.clock != key:
                heapq.heapreplace(heap, (engine.clock, index))
            else:
                break
        else:
            return None
        self._tick(index)
        engine = self.engines[index]
        heapq.heapreplace(heap, (engine.clock, index))
        return engine.clock

    def _run_workers_to(self, until: float) -> None:
        """Every worker runs on until its engine's clock reaches ``until`` (no engine step passes it), or it idles."""
        for index, engine in enumerate(self.engines):
            engine.until = until
            while engine.clock < until and self._is_runnable(index):
                self._tick(index)  # (a tick advances the clock: a step costs its overhead, a tool wait idles)
            engine.until = float("inf")
            if not engine.num_active:
                engine.wait_until(until)
        self._rebuild_runnable()

    def _rebuild_runnable(self) -> None:
        self.runnable = [(engine.clock, index) for index, engine in enumerate(self.engines) if self._is_runnable(index)]
        heapq.heapify(self.runnable)
        self.in_heap = {index for _, index in self.runnable}

    def deliver(self, shard_index: int, samples: list[Sample]) -> None:
        """A finished group reaches the shard its worker's router chose."""
        self.shards[shard_index].accept_group(samples, self.version)
        self.received += len(samples)
        self.received_tokens += sum(len(s.output_ids) for s in samples)

    def _collect_latencies(self) -> None:
        for index, worker in enumerate(self.workers):
            sent = worker.ledger["sent"]
            self.latencies.extend(entry["finished_at"] - entry["admitted_at"] for entry in sent[self._sent_seen[index]:])
            self._sent_seen[index] = len(sent)

    # ---- the trainer side: the live shards and leader ------------------------------------------

    def _ready(self) -> bool:
        """The trainer's wait loop (``DecoupledMode.train_one_step``'s step 1) with instant moves: the role's poll until no
        move is due; whether every shard can serve exactly b/A."""
        while (poll := self.role.poll(self.version, self.steps_done)) is Poll.MOVING:
            pass
        return poll is Poll.READY

    def _sync(self) -> float:
        """The weight sync, after the role evicted what the new version ages out: SyncWeights to every worker,
        which joins with its requests in the engine (one_step_off's first takes its first-token steps:
        ``ModeSettings.first_tokens_before_sync``). The sync ends ``weight_sync_s`` after the trainer joined (the
        measured seconds include the usual wait for the workers), or when the last worker joined if that is
        later; each worker then reloads for ``worker_sync_s`` (its requests holding KV prefill again). Returns the
        trainer's seconds."""
        start = self.clock
        self.weight_sync.joined = []
        for index in range(len(self.workers)):
            if self._command_now(index, SyncWeights(self.version)) is not None:
                raise RuntimeError(f"simulated worker {index} left at a weight sync")
        # the measured sync seconds include the usual wait for the workers to join (their first-token steps): the
        # trainer waits longer only for a worker that joins later than that
        end = max(self.clock + self.profile.weight_sync_s, max(self.weight_sync.joined, default=self.clock))
        for engine in self.engines:  # each waits for the broadcast, then reloads
            engine.wait_until(end)
            engine.clock += self.profile.worker_sync_s
        self.clock = end
        return end - start

    def run(self) -> dict:
        cfg = self.cfg
        while self.steps_done < cfg.steps:
            step_start = self.clock
            engines = self.engines
            busy0 = sum(e.busy_s for e in engines)
            idle0 = sum(e.idle_s for e in engines)
            self.received = self.received_tokens = 0
            self.latencies = []
            evicted_before = len(self.ledger["evicted_unused"])
            # 1. wait until every shard can serve a batch (the other workers catch up to that time, and what they
            #    deliver meanwhile goes through the same staleness check)
            while True:
                while not self._ready():
                    delivered = self.received
                    while self.received == delivered:  # the shards change only when a group arrives
                        now = self._tick_earliest()
                        if now is None:
                            raise RuntimeError(
                                f"simulated {cfg.mode} deadlocked at step {self.steps_done + 1}: no worker can run"
                            )
                        self.clock = max(self.clock, now)
                self._run_workers_to(self.clock)
                if self._ready():
                    break
            ready = self.clock
            # 2-5. the trainer role's step: plan, train (``SimTrainer``), retire, sync at sync points, progress
            self.sync_s = 0.0
            done = self.role.step(self.version, self.steps_done + 1)
            self.version, self.steps_done = done.version, self.steps_done + 1
            plans, rank_tokens = done.plans, done.stats["rank_tokens"]
            staleness = [0] * (self.settings.delta + 1)
            loss_tokens = 0.0
            for shard, plan in zip(self.shards, plans):
                shard.take_window()
                for sample in plan.fresh + plan.replayed:
                    staleness[shard.buffer.staleness(sample, done.trained_version)] += 1
                loss_tokens += sum(len(s.output_ids) for s in plan.fresh)
                loss_tokens += self.settings.tau * sum(len(s.output_ids) for s in plan.replayed)
            # the workers' reports, as the live step's row reads them (busy and idle seconds come from the engines'
            # clocks: a simulated worker never blocks, so its own idle count is zero)
            reported = self.leader.rollout_window.close()
            self._collect_latencies()
            evicted_now = self.ledger["evicted_unused"][evicted_before:]
            filtered = len(filtered_uids(evicted_now, self.ledger["eviction_causes"]))
            record = StepRecord(
                step=self.steps_done, start=step_start, end=self.clock, wait_s=ready - step_start,
                trainer_tokens=sum(rank_tokens), received=self.received,
                fresh=sum(len(p.fresh) for p in plans), replayed=sum(len(p.replayed) for p in plans),
                rollout_busy_s=sum(e.busy_s for e in engines) - busy0,
                rollout_idle_s=sum(e.idle_s for e in engines) - idle0,
                placement=self.placement, staleness=staleness, received_tokens=self.received_tokens,
                evicted=len(evicted_now) - filtered, filtered=filtered, sync_s=self.sync_s,
                engine_steps=reported["rollout_engine_steps"], step_sequences=reported["rollout_step_sequences"],
                latencies=self.latencies, loss_tokens=loss_tokens,
            )
            self.records.append(record)
            self.leader.placement_rows.append(record.as_row())
            # 6. placement, at sync points
            if self.planner is not None and self.version % self.settings.interval == 0 and self.steps_done < cfg.steps:
                decision = self.leader.decide_placement(self.steps_done, self.replicas)
                if decision.target is not None:
                    self._transition(decision.target)
                    self.transitions[-1]["reason"] = decision.reason
        result = summarize(self.records, cfg.warmup_steps, self.transitions)
        # staleness waste, as the modes benchmark counts it: filtered samples had no signal for any rule to train
        filtered = len(filtered_uids(self.ledger["evicted_unused"], self.ledger["eviction_causes"]))
        evicted = len(self.ledger["evicted_unused"]) - filtered
        result["evicted_unused"] = evicted
        result["filtered_unused"] = filtered
        trained_fresh = sum(r.fresh for r in self.records)
        result["evicted_fraction"] = evicted / max(evicted + trained_fresh, 1)
        result["moved_between_shards"] = len(self.ledger["moved_in"])
        result["preemptions"] = sum(engine.preemptions for engine in self.engines_ever)
        result["staleness_counts"] = [sum(r.staleness[k] for r in self.records) for k in range(self.settings.delta + 1)]
        return result


def simulate_sync(cfg: SimConfig, profile: CostProfile, workload: Workload) -> dict:
    """Colocated on-policy GRPO: every GPU generates its share, then every GPU trains, then the sync. With
    dynamic sampling, as ``SyncMode``'s step 4: after a round the GPUs agree on the groups with signal (each
    waits for the slowest); while fewer than P are kept, the missing number of prompts is generated in another
    round, at most MAX_EXTRA_BATCHES extra rounds; the step trains on the kept groups only."""
    rng, train_rng = random.Random(cfg.seed), random.Random(cfg.seed + 1)
    engines = [SimEngine(profile, i, cfg.macro_steps, cfg.macro_s) for i in range(cfg.gpus)]
    clock, records, draws = 0.0, [], 0
    for step in range(1, cfg.steps + 1):
        start = clock
        busy0, idle0 = sum(e.busy_s for e in engines), sum(e.idle_s for e in engines)
        steps0, sequences0 = sum(e.engine_steps for e in engines), sum(e.step_sequences for e in engines)
        rows: list[list[int]] = [[] for _ in range(cfg.gpus)]  # trained: each kept sample's tokens, per GPU
        response_tokens = 0  # and their response tokens, all GPUs
        kept = generated_groups = rounds = 0
        round_start = start
        while True:
            count = cfg.prompts_per_step - kept  # the whole P first, then what is missing
            group_tokens: dict[str, tuple[int, list[int], int]] = {}  # group -> (GPU, each sample's tokens, responses)
            round_draws = list(range(draws, draws + count))
            draws += count
            for prompt, draw in enumerate(round_draws):
                rank, group = prompt % cfg.gpus, f"g{draw}"
                group_tokens[group] = (rank, [], 0)
                prompt_tokens, lengths = workload.draw_group(rng, step - 1, cfg.group_size)
                prompt_ids = [0] * prompt_tokens
                for k, target in enumerate(lengths):
                    engines[rank].add(Request(f"{group}/{k}", prompt_ids, workload.max_tokens, k,
                                              meta={"group": group, "sim": SimTrajectory(target)}))
            for engine in engines:
                engine.clock = round_start
                while engine.num_active:
                    for req in engine.step():
                        rank, samples, response = group_tokens[req.meta["group"]]
                        samples.append(len(req.prompt_ids) + len(req.output_ids))
                        group_tokens[req.meta["group"]] = (rank, samples, response + len(req.output_ids))
            generated = max(engine.clock for engine in engines)
            generated_groups += count
            for draw in round_draws:
                if not cfg.dynamic_sampling or workload.has_signal(cfg.seed, draw):
                    rank, samples, group_response = group_tokens[f"g{draw}"]
                    rows[rank].extend(samples)
                    response_tokens += group_response
                    kept += 1
            if not cfg.dynamic_sampling or kept >= cfg.prompts_per_step or rounds == MAX_EXTRA_BATCHES:
                break
            rounds += 1
            for engine in engines:  # the agreement on what was kept: each waits for the slowest
                engine.idle_s += generated - engine.clock
                engine.clock = generated
            round_start = generated
        charged = max(profile.charged_tokens(r, cfg.micro_batch_size, cfg.micro_batch_tokens) for r in rows)
        train = profile.train_seconds(charged, cfg.gpus, train_rng)
        sync = profile.weight_sync_s + profile.worker_sync_s  # the gather, then each GPU reloads its own engine
        clock = generated + train + profile.step_fixed_s + sync
        for engine in engines:  # each waits for the slowest, then for training and the sync
            engine.idle_s += clock - engine.clock
            engine.clock = clock
        records.append(StepRecord(
            step=step, start=start, end=clock, wait_s=generated - start, trainer_tokens=sum(map(sum, rows)), sync_s=sync,
            received=generated_groups * cfg.group_size, fresh=kept * cfg.group_size, replayed=0,
            filtered=(generated_groups - kept) * cfg.group_size,
            rollout_busy_s=sum(e.busy_s for e in engines) - busy0, rollout_idle_s=sum(e.idle_s for e in engines) - idle0,
            engine_steps=sum(e.engine_steps for e in engines) - steps0,
            step_sequences=sum(e.step_sequences for e in engines) - sequences0,
            placement=placement_name(1, cfg.gpus, 0), loss_tokens=response_tokens,
        ))
    return dict(summarize(records, cfg.warmup_steps, []), evicted_fraction=0.0)  # (every group generated is trained)


def simulate(cfg: SimConfig, profile: CostProfile, workload: Workload) -> dict:
    """One simulation, with Python's cycle collector paused: a simulation allocates millions of short-lived
    objects beside a growing set of long-lived ones (the ledger, the buffers' samples), and the collector's
    passes over the long-lived ones were a third of a 128-GPU run's time (one_step_off: 23.1 s against 14.3 s
    paused). Its garbage is freed by reference counting; what cycles it leaves (the peak resident memory grew
    by 73 MB, to 330 MB) are collected once the collector is back."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if cfg.mode == "sync":
            return simulate_sync(cfg, profile, workload)
        return DecoupledSim(cfg, profile, workload).run()
    finally:
        if was_enabled:
            gc.enable()


def simulate_seeds(cfg: SimConfig, profile: CostProfile, workload: Workload, seeds: int) -> dict:
    """The mean of ``seeds`` simulations of ``cfg`` that differ only in their random streams (seeds
    ``cfg.seed``, ``cfg.seed + 1``, ...): ``average_runs`` of them. One simulation draws its groups' lengths and
    its trainer's noise from one stream, and on the long-tailed rollout-bound bench its fresh samples/s moves by
    4-6% from one seed to the next (20 seeds of the async fit: 119.1 +- 4.8): a simulation set against the mean
    of several measured runs is set against the mean of as many seeds or more."""
    return average_runs(seeded_runs(cfg, profile, workload, seeds))


def seeded_runs(cfg: SimConfig, profile: CostProfile, workload: Workload, seeds: int) -> list[dict]:
    """``seeds`` simulations of ``cfg`` with seeds ``cfg.seed``, ``cfg.seed + 1``, ...: each its own random stream."""
    if seeds < 1:
        raise ValueError(f"seeds must be at least 1, got {seeds}")
    return [simulate(replace(cfg, seed=cfg.seed + k), profile, workload) for k in range(seeds)]


def average_runs(runs: list[dict]) -> dict:
    """Simulation summaries as one: every number averaged, the rest (the timeline, the transitions) the first
    run's, with ``seeds`` (how many) and ``seed_sd`` (each number's standard deviation over them) added."""
    numbers = [key for key, value in runs[0].items() if isinstance(value, (int, float)) and not isinstance(value, bool)]
    result, deviations, count = dict(runs[0]), {}, len(runs)
    for key in numbers:
        values = [run[key] for run in runs]
        mean = sum(values) / count
        result[key] = mean
        deviations[key] = (sum((v - mean) ** 2 for v in values) / (count - 1)) ** 0.5 if count > 1 else 0.0
    result["seeds"] = count
    result["seed_sd"] = deviations
    return result


def simulate_job(job: tuple[SimConfig, CostProfile, Workload]) -> dict:
    """``simulate`` of one (config, profile, workload): what a process pool's worker runs; ``wall_s`` is the
    simulation's own run time (the pool's critical path is the longest of them)."""
    t0 = time.perf_counter()
    result = simulate(*job)
    result["wall_s"] = time.perf_counter() - t0
    return result
