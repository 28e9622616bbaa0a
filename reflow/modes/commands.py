"""The typed commands trainer rank 0 sends to the rollout ranks on the control plane.

SyncWeights at sync points; Progress after every step (after that step's SyncWeights) and whenever the
retired counts change while the trainer waits; Stop once. See docs/decoupled_protocol.md for the protocol."""

from __future__ import annotations

from dataclasses import dataclass

from reflow.scheduler.dispatch import DispatchBudget
from reflow.scheduler.routing import ShardRouter


@dataclass(frozen=True)
class SyncWeights:
    """Join the weight sync to ``version`` now (holding in-flight requests as partial rollouts)."""

    version: int


@dataclass(frozen=True)
class Progress:
    """The trainer's progress as this rollout worker needs it (cumulative counts, so a late or repeated word is
    harmless)."""

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


@dataclass(frozen=True)
class Stop:
    """Training is over: drop in-flight requests, send END on the data plane, exit."""


Command = SyncWeights | Progress | Transition | Stop


def apply_progress(progress: Progress, budget: DispatchBudget, router: ShardRouter) -> None:
    """A Progress word: the trainer's counts (and the grants, with the global dispatcher) to the dispatch
    budget, the shards' unused counts to the router. Cumulative counts: a late or repeated word is harmless."""
    budget.update(progress.steps_done, progress.retired, progress.filtered)
    if progress.granted is not None:
        budget.grant(progress.granted)
    router.update(progress.shard_unused)
