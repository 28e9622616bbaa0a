"""Simulated workloads: prompt lengths and response lengths (long-tailed, optionally drifting longer as
training goes on), and optional tool latency per turn."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    median_tokens: float
    """Median response length at step 0."""
    sigma: float
    """Log-normal shape: larger is a longer tail."""
    max_tokens: int
    drift_per_step: float = 0.0
    """Relative growth of the median per trainer step (0.01: 1% longer each step)."""
    tool_turns: int = 0
    tool_latency_s: float = 0.0
    """Seconds a trajectory waits on its tool per turn (the engine keeps serving the others)."""
    empirical: tuple[int, ...] = field(default=())
    """Response lengths to resample from instead of the log-normal (a dataset's answers)."""
    length_schedule: tuple[tuple[int, float], ...] = ()
    """(from step, factor): the lengths are multiplied by the factor of the latest entry at or before the step
    (a workload whose rollout cost per token rises and falls: attention over a longer context costs more)."""

    def length_factor(self, step: int) -> float:
        factor = 1.0
        for start, value in self.length_schedule:
            if step >= start:
                factor = value
        return factor

    def response_length(self, rng: random.Random, step: int) -> int:
        scale = (1.0 + self.drift_per_step) ** step * self.length_factor(step)
        if self.empirical:
            length = rng.choice(self.empirical) * scale
        else:
            length = self.median_tokens * scale * math.exp(rng.gauss(0.0, self.sigma))
        return max(1, min(self.max_tokens, int(length)))


def chain_sum_workload(train_file: str, max_tokens: int, name: str = "chain_sum") -> Workload:
    """The chain_sum task's lengths as the tiny model writes them (the tiny tokenizer is per character):
    the prompt "d+d+...=" with BOS, and the answer's running sums with EOS."""
    prompts, answers = [], []
    with open(train_file, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            prompts.append(len(row["prompt"]) + 1)
            answers.append(min(max_tokens, len(row["answer"]) + 1))
    return Workload(
        name=name, prompt_tokens=round(sum(prompts) / len(prompts)), median_tokens=sorted(answers)[len(answers) // 2],
        sigma=0.0, max_tokens=max_tokens, empirical=tuple(answers),
    )


REASONING_DRIFT = Workload(
    name="reasoning-drift", prompt_tokens=256, median_tokens=1200, sigma=0.9, max_tokens=16_384, drift_per_step=0.01,
)
"""Reasoning RL on a Qwen3-8B-class model: long-tailed responses whose median grows 1% per step."""
