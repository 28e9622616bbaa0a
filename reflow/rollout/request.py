"""A sample-level generation request and what generating it produced: what every ``Engine`` takes and
returns (``reflow.rollout.protocols``), the live vLLM engine and the simulator's alike."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    """A sample-level generation request (one completion of one prompt)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    meta: dict = field(default_factory=dict)
    ignore_eos: bool = False
    """Generate exactly max_tokens (synthetic workloads with a chosen length distribution: benchmarks)."""
    stop: tuple[str, ...] = ()
    """Strings that end a model turn (a multi-turn task's tool call, a served request's ``stop``); the string is
    kept in the output."""
    turn_end: int | None = None
    """Where the current model turn must end, as a length of ``output_ids`` (an agent's call's ``max_tokens``:
    ``reflow.serving.agents``); None: at ``max_tokens``, the trajectory's own limit."""
    temperature: float | None = None
    top_p: float | None = None
    """Sampling settings of this request alone (a served request's); None: the run's [rollout] settings, the
    distribution the trainer's log-probs assume (every training request)."""
    # filled while generating
    output_ids: list[int] = field(default_factory=list)
    """The response: the model's tokens and, in a multi-turn trajectory, the environment's between its turns."""
    logprobs: list[float] = field(default_factory=list)
    """One per model token (``model_spans``), in order: the environment's tokens have none."""
    versions: list[int] = field(default_factory=list)
    """The policy version that produced each model token."""
    adapter_version: int | None = None
    """A LoRA run: the adapter version this trajectory started on, which samples every token of it
    (``RolloutEngine.load_adapter``); None: the engine's weights of the moment."""
    model_spans: list[list[int]] = field(default_factory=list)
    """[start, end) ranges of ``output_ids`` the model generated, one per model turn."""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """The stop string (or token) that ended the latest model turn; None at EOS or the length limit."""
    reward: float | None = None
    """Set by ``reflow.rollout.scoring.trajectory_reward`` (for a multi-turn task on the tool pool)."""
    reward_parts: dict[str, float] | None = None
    """Each reward function's value (and the overlong shaping), when the run's reward is a mix."""
    tool_calls: int = 0
    tool_s: float = 0.0
    """Wall time the trajectory spent waiting on its environment, apart from engine time."""

    def append_model_tokens(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        start = len(self.output_ids)
        self.output_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(token_ids))
        if self.model_spans and self.model_spans[-1][1] == start:
            self.model_spans[-1][1] = len(self.output_ids)
        elif token_ids:
            self.model_spans.append([start, len(self.output_ids)])

    @property
    def generation_limit(self) -> int:
        """The length of ``output_ids`` at which the engine stops this request (its turn's end, or its own)."""
        return self.max_tokens if self.turn_end is None else min(self.turn_end, self.max_tokens)

    def append_environment_tokens(self, token_ids: list[int]) -> None:
        self.output_ids.extend(token_ids)
