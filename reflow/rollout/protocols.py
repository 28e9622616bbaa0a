"""What a rollout worker is written against, as protocols: the live vLLM engine (``RolloutEngine``) and the
simulator's (``reflow.sim.engine.SimEngine``) are both an ``Engine``; the live run draws its groups from the
prompt stream and scores them with the task (``PromptGroups``, ``TaskScorer``), the simulator from a
workload (``reflow.sim.system``). ``reflow.modes.rollout_worker.RolloutWorker`` runs unchanged over either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from reflow.rollout.kv_signals import EngineSignals
    from reflow.rollout.request import Request
    from reflow.rollout.tensor_parallel import EngineMirror
    from reflow.types import Sample


@runtime_checkable
class Engine(Protocol):
    """A continuous-batching engine driven step by step.

    ``add`` queues a request (one with output already resumes from its prefix); ``step`` runs one engine step
    (``decode_steps`` decode steps: 1 live, a few in the simulator) and returns the requests that finished;
    ``hold_all`` stops every request in flight keeping its tokens, ``resume`` puts held ones back, ``abort``
    stops one (its tokens kept);
    ``load_weights`` replaces the weights under the requests in flight (every later token carries
    ``version``): those holding KV (``holding_kv``) are preempted and prefill their prompt and prefix again,
    queued ones are untouched; ``signals`` are the KV cache's after the latest step."""

    version: int
    signals: "EngineSignals"
    active: "dict[str, Request]"
    """Engine request id -> request, for every request in flight."""
    mirror: "EngineMirror | None"
    block_size: int
    """Tokens per KV block."""
    decode_steps: int
    """Decode steps the latest ``step`` ran."""
    sampled_tokens: int
    """Tokens sampled since the engine was built, one per running sequence per decode step: what an engine
    step's cost grows with (``num_active`` counts the queued requests too, which cost nothing)."""
    pins_versions: bool
    """A sync adds a policy version and holds nothing: each request finishes on the version it started on (a
    LoRA run's adapters, ``RolloutEngine.load_adapter``); False: a sync replaces the weights under held
    requests (partial rollouts, a version per token)."""

    @property
    def num_active(self) -> int: ...

    def add(self, req: "Request") -> None: ...

    def step(self) -> "list[Request]": ...

    def step_until_started(self) -> "tuple[list[Request], list[int]]":
        """Step until every request in flight has a token: what finished, and the sequences of each step."""

    def hold_all(self) -> "list[Request]": ...

    def holding_kv(self) -> "list[Request]": ...

    def abort(self, request_id: str) -> "Request | None": ...

    def resume(self, held: "Iterable[Request]") -> None: ...

    def load_weights(self, named_tensors: "Iterable[tuple[str, torch.Tensor]]", version: int) -> float: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


@runtime_checkable
class GroupSource(Protocol):
    """Where a rollout worker's request groups come from: its share of the prompt stream (``peek`` the next
    draw index, ``take`` it) and the G requests of a draw started under a version."""

    def peek(self) -> int: ...

    def take(self) -> int: ...

    def requests(self, draw: int, version: int) -> "list[Request]": ...


@runtime_checkable
class GroupScorer(Protocol):
    """A finished group's requests as scored samples, advantages set."""

    def score(self, members: "list[Request]") -> "list[Sample]": ...


@runtime_checkable
class WeightReceiver(Protocol):
    """A rollout worker's side of the weight sync: load ``version`` into its engine (a collective live)."""

    def sync(self, trainer, engine: Engine, version: int) -> dict: ...
