"""The typed commands trainer rank 0 sends to every rollout rank on the control plane (in this order per step).

See ``reflow.modes.decoupled`` for the protocol they implement."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncWeights:
    """Join the weight sync to ``version`` now (holding in-flight requests as partial rollouts)."""

    version: int


@dataclass(frozen=True)
class Progress:
    """The trainer's progress as this rollout rank's dispatch budget needs it (cumulative, so idempotent)."""

    steps_done: int
    retired: tuple[int, ...]
    """Per trainer shard: samples of this rollout rank trained for the first time or evicted unused."""


@dataclass(frozen=True)
class Stop:
    """Training is over: drop in-flight requests, send END on the data plane, exit."""


Command = SyncWeights | Progress | Stop
