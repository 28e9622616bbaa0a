"""The vocabulary of a decoupled run's roles, in one place: the sample and its life, the commands, and the
typed data-plane messages.

A ``Sample`` moves through the ``SampleStage``s and only along ``NEXT_STAGES`` (``Sample.enter`` refuses any
other move): the rollout worker that scored it sends it, trainer shards receive, move, hand over, train and
retire it (``docs/decoupled_protocol.md``, "A sample's life").

Commands go from trainer rank 0 to the rollout workers on the control plane (``Command``):

  SyncWeights  join the weight sync to a version now
  Progress     the trainer's counts a rollout worker's dispatch budget and router need
  Transition   the placement changes after this step
  Stop         training is over

Everything else goes on the data plane as one of these, never as a dict:

  GroupDone    rollout worker -> the trainer shard its router chose: a finished, scored group
  Moved        trainer shard -> trainer shard: eligible samples another shard's batch needs (``plan_moves``)
  Handover     leaving trainer shard -> its heir at a placement change: its whole buffer, and the draws it
               had received (for the checkpoints' prompt holes)
  WorkerStats  rollout worker -> trainer rank 0, about once a second: engine, idle and tool time, the
               admission gate's window and its load report for the global dispatcher
  EvalShare    rollout worker -> trainer rank 0: its share of the held-out evaluation of one version
  Flush        rollout worker -> every trainer shard at a placement change: nothing more follows

and, in the trainer's one collective of its wait loop, each shard's ``ShardReadiness``, combined into the
``TrainerView`` every trainer rank computes the same moves from.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol, Sequence

from reflow.scheduler.dispatch import WorkerReport

if TYPE_CHECKING:
    from reflow.rollout.request import Request
from reflow.scheduler.routing import Move, ShardCounts, plan_moves


class SampleStage(enum.Enum):
    """Where a sample is in its life. Eligibility for a batch is not a stage: a RECEIVED sample is eligible at a
    version while its staleness is within [min_staleness, delta], which the version moves, not an event."""

    FINISHED = "finished"
    """Its group finished and was scored, in a rollout worker."""
    SENT = "sent"
    """On the data plane to the trainer shard its router chose (``GroupDone``)."""
    RECEIVED = "received"
    """In a trainer shard's buffer, never trained."""
    MOVED = "moved"
    """Given by one trainer shard to another whose batch needs it (``Moved``), not yet arrived."""
    HANDED_OVER = "handed_over"
    """A leaving shard's buffer on its way to its heir at a placement change (``Handover``)."""
    TRAINED = "trained"
    """Trained at least once and kept for replay (the replay filter accepted it)."""
    DROPPED = "dropped"
    """Trained, and then dropped from replay: the filter refused it, or it aged past delta. Final."""
    EVICTED = "evicted"
    """Never trained: it arrived or aged past its bound, or dynamic sampling filtered its group. Final."""


NEXT_STAGES: dict[SampleStage, frozenset[SampleStage]] = {
    SampleStage.FINISHED: frozenset({SampleStage.SENT}),
    SampleStage.SENT: frozenset({SampleStage.RECEIVED, SampleStage.EVICTED}),
    SampleStage.RECEIVED: frozenset({
        SampleStage.MOVED, SampleStage.HANDED_OVER, SampleStage.TRAINED, SampleStage.DROPPED, SampleStage.EVICTED,
    }),
    SampleStage.MOVED: frozenset({SampleStage.RECEIVED}),
    SampleStage.HANDED_OVER: frozenset({SampleStage.RECEIVED, SampleStage.TRAINED}),
    SampleStage.TRAINED: frozenset({SampleStage.TRAINED, SampleStage.DROPPED, SampleStage.HANDED_OVER}),
    SampleStage.DROPPED: frozenset(),
    SampleStage.EVICTED: frozenset(),
}
"""The moves a sample may make: what the roles do to it, and nothing else (a test walks them)."""


AGENT_FAILURES = ("error", "timeout", "turn_budget", "token_budget", "diverged", "bad_reward")
"""Causes of a failed agent episode (``reflow.serving.agents``), as ``Sample.agent_failure`` and the metrics
(``agent_<cause>``) name them."""


@dataclass
class Sample:
    """One finished trajectory: what the trainer needs, plus the replay bookkeeping."""

    uid: str
    draw: int
    """Position of its prompt in the run's prompt stream."""
    group_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    """One per model token (``model_spans``)."""
    versions: list[int]
    reward: float
    finish_reason: str | None = None
    model_spans: list[list[int]] | None = None
    """[start, end) ranges of ``output_ids`` the model generated; None: all of them (a single-turn sample).
    The rest came from the environment (a multi-turn task's tool answers) and is never trained on."""
    tool_calls: int = 0
    tool_s: float = 0.0
    """Seconds the trajectory waited on its environment."""
    agent_failure: str = ""
    """An agent episode that failed: its cause (one of ``AGENT_FAILURES``); "": none."""
    token_mismatches: int = 0
    """An agent episode's calls whose prompt did not extend its sampled tokens (``reflow.serving.agents``)."""
    origin: int = -1
    """Index of the rollout worker whose dispatch budget it counts against (-1: none, as after a resume or a
    placement change, whose budgets start afresh)."""
    finish_version: int = -1
    """Engine version at which its group finished (-1: not recorded, as in checkpoints of older runs; the
    newest token's version stands in)."""
    advantage: float = 0.0
    group_reward_mean: float = 0.0
    reward_parts: dict[str, float] | None = None
    """The reward's parts before their weights (``reflow.rewards``): each function's value, and the overlong
    shaping; None in a sample scored by the task alone."""
    use_count: int = 0
    inserted_at: float = field(default_factory=time.time)
    stage: SampleStage = SampleStage.FINISHED
    """Where it is in its life (``SampleStage``); a sample of an older checkpoint reads the default."""

    def enter(self, stage: SampleStage) -> None:
        """Move to ``stage``; a move ``NEXT_STAGES`` does not allow is a bug in a role: it raises."""
        if stage not in NEXT_STAGES[self.stage]:
            raise RuntimeError(f"sample {self.uid}: no move from {self.stage.value} to {stage.value}")
        self.stage = stage

    @property
    def buffered_stage(self) -> SampleStage:
        """The stage of this sample in a shard's buffer: RECEIVED if never trained, else TRAINED."""
        return SampleStage.RECEIVED if self.use_count == 0 else SampleStage.TRAINED

    @property
    def birth_version(self) -> int:
        """Version of the policy that produced the oldest token. Tokens are generated in order and an engine's
        version only grows, so ``versions`` is non-decreasing and the oldest is the first (read per sample at
        every readiness check: O(1), not a scan of the response)."""
        return self.versions[0] if self.versions else -1

    @property
    def completed_version(self) -> int:
        """Version at which its group finished."""
        if self.finish_version >= 0:
            return self.finish_version
        return self.versions[-1] if self.versions else -1

    def anchor_version(self, anchor: str) -> int:
        """The version its staleness counts from: ``finish`` (its group's completion) or ``start`` (its birth)."""
        if anchor == "finish":
            return self.completed_version
        if anchor == "start":
            return self.birth_version
        raise ValueError(f"staleness anchor must be 'finish' or 'start', got {anchor!r}")

    def staleness(self, current_version: int, anchor: str = "start") -> int:
        return current_version - self.anchor_version(anchor)

    def head_lag(self, current_version: int) -> int:
        """How many versions its oldest token is behind ``current_version``."""
        return current_version - self.birth_version


@dataclass(frozen=True)
class GroupDone:
    samples: list[Sample]


@dataclass(frozen=True)
class Moved:
    samples: list[Sample]


@dataclass(frozen=True)
class Handover:
    samples: list[Sample]
    draws: frozenset[int]


@dataclass
class HeldGroup:
    """A group in flight at a placement change (a partial rollout): its requests stopped with their prefix
    (prompt, output ids, log-probs, per-token versions), and its members that had already finished. The
    placement change hands it to a rollout worker of the new placement, which resumes it."""

    group_id: str
    held: list["Request"]
    finished: list["Request"]

    @property
    def request_ids(self) -> list[str]:
        return [req.request_id for req in self.held + self.finished]


@dataclass(frozen=True)
class EvalShare:
    version: int
    reward_sum: float
    count: int


@dataclass(frozen=True)
class Flush:
    pass


# ---- commands: trainer rank 0 -> rollout workers, on the control plane ------------------------------------


@dataclass(frozen=True)
class SyncWeights:
    """Join the weight sync to ``version`` now (holding in-flight requests as partial rollouts)."""

    version: int


@dataclass(frozen=True)
class Progress:
    """The trainer's progress as this rollout worker needs it (cumulative counts, so a late or repeated word is
    harmless). Sent after every step (after that step's SyncWeights) and whenever the counts change while the
    trainer waits."""

    steps_done: int
    retired: int
    """Samples of this worker trained for the first time or evicted unused, over all trainer shards."""
    granted: int | None = None
    """Samples the global dispatcher has granted this worker so far (scheduler.kv_admission in async and
    reflow); None with fixed shares."""
    shard_unused: tuple[int, ...] | None = None
    """Unused samples per trainer shard when this word was sent: where finished groups are routed."""
    filtered: int = 0
    """Of this worker's retired samples, those dropped for carrying no signal (dynamic sampling): they give
    their per-step credit (B_max) back."""


@dataclass(frozen=True)
class Transition:
    """The placement changes to ``replicas`` trainer replicas after this step: hold what is in flight as partial
    rollouts and join the transition (``reflow.modes.transition``), which hands them to the new placement."""

    replicas: int


@dataclass
class ResizeReport:
    """What one rank did in a placement change's trainer resize (``PolicyTrainer.resize``; the simulator's
    ``SimTrainer.resize``): ``transition_event`` sums it over the ranks."""

    source: str
    """The trainer layout before ("T2x2")."""
    target: str
    direction: str = "none"
    """'trainer->rollout' (replicas leave), 'rollout->trainer' (replicas join) or 'none'."""
    bytes_moved: int = 0
    """Received as a joining rank: shards, AdamW step counters and the update counter."""
    bytes_freed: int = 0
    """Freed as a leaving rank."""
    broadcasts: int = 0
    tensors: int = 0
    """Tensors in the transfer (when replicas joined)."""
    copied_not_aliased: list[str] = field(default_factory=list)
    """Shards FSDP had to copy rather than adopt (a dim 0 that does not divide by the shard degree)."""

    @staticmethod
    def direction_of(old_replicas: int, new_replicas: int) -> str:
        if new_replicas == old_replicas:
            return "none"
        return "trainer->rollout" if new_replicas < old_replicas else "rollout->trainer"


@dataclass(frozen=True)
class Stop:
    """Training is over: drop in-flight requests, send END on the data plane, exit."""


Command = SyncWeights | Progress | Transition | Stop


@dataclass(slots=True)
class WorkerStats:
    """A rollout worker's window (since its previous report). ``a + b`` is the two windows together: the
    counts and seconds add up, the cap and the load report are the later window's."""

    busy_s: float = 0.0
    """Engine time, less the time the turn driver waited on tools inside a step."""
    idle_s: float = 0.0
    """Nothing in flight: waiting for a command."""
    tool_wait_s: float = 0.0
    """An empty engine with trajectories waiting on their environment (working time, not idle)."""
    engine_steps: int = 0
    step_sequences: int = 0
    """Sequences summed over the engine steps (mean in flight = step_sequences / engine_steps)."""
    sampled_tokens: int = 0
    """Tokens the engine sampled (``Engine.sampled_tokens``): the running sequences summed over the steps."""
    prefilled_tokens: int = 0
    """Prompt and prefix tokens the engine prefilled: new requests, and those a sync preempted, again."""
    sync_s: float = 0.0
    """Weight syncs from the worker's side: the broadcast and the engine's reload (and, at a sync that evaluates,
    the held requests added back; its first-token steps are engine time, its evaluation busy time)."""
    syncs: int = 0
    held_at_sync: int = 0
    """Requests whose prompt and prefix a weight sync made the engine prefill again: at a full-weight sync every
    one holding KV (``Engine.holding_kv``; queued ones wait on untouched), at a sync that evaluates every one in
    flight; none at a LoRA run's adapter sync unless it evaluates (``Engine.pins_versions``)."""
    preemptions: int = 0
    admitted_groups: int = 0
    gate_refusals: int = 0
    kv_usage_sum: float = 0.0
    """KV usage summed over the engine steps."""
    cap: int | None = None
    cap_changes: tuple[tuple[str, int, int], ...] = ()
    """(reason, previous cap, new cap) of every change the concurrency controller made."""
    load: WorkerReport | None = None
    """What the global dispatcher weighs (scheduler.kv_admission), else None."""

    SUMMED = (
        "busy_s", "idle_s", "tool_wait_s", "engine_steps", "step_sequences", "sampled_tokens", "prefilled_tokens",
        "sync_s", "syncs", "held_at_sync", "preemptions", "admitted_groups", "gate_refusals", "kv_usage_sum",
    )

    def __add__(self, later: "WorkerStats") -> "WorkerStats":
        summed = {name: getattr(self, name) + getattr(later, name) for name in self.SUMMED}
        return WorkerStats(
            **summed, cap=later.cap if later.cap is not None else self.cap,
            cap_changes=self.cap_changes + later.cap_changes, load=later.load if later.load is not None else self.load,
        )

    @property
    def working_s(self) -> float:
        return self.busy_s + self.tool_wait_s

    @property
    def kv_usage_mean(self) -> float:
        return self.kv_usage_sum / self.engine_steps if self.engine_steps else 0.0


ENGINE_WINDOW_KEYS = {
    "rollout_busy_s": "busy_s", "rollout_engine_steps": "engine_steps", "rollout_step_sequences": "step_sequences",
    "rollout_prefilled_tokens": "prefilled_tokens", "rollout_sampled_tokens": "sampled_tokens",
}
"""Metrics-row key -> ``WorkerStats`` field of an engine window: what the decoupled modes' leader and sync mode
log, and what ``reflow.sim.profiles.fit_profile`` reads."""


assert set(WorkerStats.SUMMED) <= {f.name for f in fields(WorkerStats)}

@dataclass(frozen=True)
class ShardReadiness:
    """One shard's report to the readiness exchange."""

    ready: bool
    """It can serve a batch of exactly b/A now and awaits no moved sample."""
    retired: tuple[int, ...]
    """Samples retired (trained for the first time, or evicted unused), per rollout worker, since its budgets
    started."""
    filtered: tuple[int, ...]
    """Of those, the samples dropped on arrival for carrying no signal (dynamic sampling, eviction cause
    "no_signal"), per rollout worker: they refund the per-step credit (B_max)."""
    eligible: int
    """Unused samples it could train now, those on their way to it included."""
    need: int
    """Fresh samples its next batch needs."""
    urgent: int
    """Eligible samples at the last version their bound allows."""
    unused: int
    """Unused samples it holds or awaits (what the router balances)."""


@dataclass(frozen=True)
class TrainerView:
    """Every shard's readiness, combined: the same on every trainer rank."""

    all_ready: bool
    retired: tuple[int, ...]
    """Per rollout worker, summed over the shards."""
    filtered: tuple[int, ...]
    """Per rollout worker, summed over the shards: retired samples that were filtered (no signal)."""
    eligible: tuple[int, ...]
    need: tuple[int, ...]
    urgent: tuple[int, ...]
    unused: tuple[int, ...]

    @classmethod
    def combine(cls, reports: Sequence[ShardReadiness]) -> "TrainerView":
        return cls(
            all_ready=all(r.ready for r in reports),
            retired=tuple(sum(column) for column in zip(*(r.retired for r in reports))),
            filtered=tuple(sum(column) for column in zip(*(r.filtered for r in reports))),
            eligible=tuple(r.eligible for r in reports),
            need=tuple(r.need for r in reports),
            urgent=tuple(r.urgent for r in reports),
            unused=tuple(r.unused for r in reports),
        )

    def moves(self, batch_per_shard: int) -> list[Move]:
        """``plan_moves`` of these counts (R4's surplus for short shards, then what is due and cannot be taken)."""
        return plan_moves([ShardCounts(e, n, u, batch_per_shard) for e, n, u in zip(self.eligible, self.need, self.urgent)])


class ReadinessExchange(Protocol):
    """The one collective of the trainer's wait loop: every shard's readiness to every shard. ``reports``: those
    of the shards this process holds (one on a live rank; every shard in the simulator)."""

    def exchange(self, reports: Sequence[ShardReadiness]) -> TrainerView: ...


class InProcessExchange:
    """A ``ReadinessExchange`` for a process that holds every shard (the simulator, tests): their reports,
    combined."""

    def exchange(self, reports: Sequence[ShardReadiness]) -> TrainerView:
        return TrainerView.combine(reports)


DataMessage = GroupDone | Moved | Handover | WorkerStats | EvalShare | Flush
