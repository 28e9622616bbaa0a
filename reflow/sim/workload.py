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
    empirical_groups: tuple[tuple[int, ...], ...] = field(default=())
    """Response lengths to resample from instead of the log-normal, a group at a time: each entry is the
    lengths of one group (a run's ledger), or one prompt's answer length (a dataset). A group of answers to
    one prompt has lengths alike, and it finishes with its longest member: drawing its members apart from
    all prompts' lengths would make that maximum twice the measured one (38.6 against 16.8 tokens on the
    modes benchmark's reflow run)."""
    empirical_prompt_tokens: tuple[int, ...] = field(default=())
    """The prompt length of each of ``empirical_groups`` (same order), where known; else every prompt is
    ``prompt_tokens`` long. Under KV pressure a prompt's length matters as its answer's does: long chain_sum
    answers come with long prompts, and a prompt of a full KV block or more is shared by its group."""
    no_signal_fraction: float = 0.0
    """Share of groups whose rewards are all equal (every answer right, or none): what DAPO's dynamic sampling
    filters (``SimConfig.dynamic_sampling``). Which groups they are is a function of the seed and the draw."""
    length_schedule: tuple[tuple[int, float], ...] = ()
    """(from step, factor): the lengths are multiplied by the factor of the latest entry at or before the step
    (a workload whose rollout cost per token rises and falls: attention over a longer context costs more)."""

    def length_factor(self, step: int) -> float:
        factor = 1.0
        for start, value in self.length_schedule:
            if step >= start:
                factor = value
        return factor

    def has_signal(self, seed: int, draw: int) -> bool:
        """Whether draw ``draw``'s group has rewards that differ (``no_signal_fraction`` of the groups do not)."""
        if self.no_signal_fraction <= 0:
            return True
        return random.Random(seed * 1_000_003 + draw).random() >= self.no_signal_fraction

    def group_lengths(self, rng: random.Random, step: int, group_size: int) -> list[int]:
        """The response lengths of one group (``draw_group``'s, without its prompt length)."""
        return self.draw_group(rng, step, group_size)[1]

    def draw_group(self, rng: random.Random, step: int, group_size: int) -> tuple[int, list[int]]:
        """One group of ``group_size`` answers drawn at trainer step ``step``: its prompt length and its response
        lengths. An empirical group (its members drawn from it when it is not of that size) with its own prompt
        length where known, else ``prompt_tokens`` and independent log-normal lengths."""
        scale = (1.0 + self.drift_per_step) ** step * self.length_factor(step)
        prompt = self.prompt_tokens
        if self.empirical_groups:
            index = rng.randrange(len(self.empirical_groups))  # (the stream rng.choice would have drawn)
            members = self.empirical_groups[index]
            if self.empirical_prompt_tokens:
                prompt = self.empirical_prompt_tokens[index]
            lengths = members if len(members) == group_size else [rng.choice(members) for _ in range(group_size)]
            raw = [length * scale for length in lengths]
        else:
            raw = [self.median_tokens * scale * math.exp(rng.gauss(0.0, self.sigma)) for _ in range(group_size)]
        return prompt, [max(1, min(self.max_tokens, int(length))) for length in raw]


def chain_sum_prompt_tokens(train_file: str) -> dict[str, int]:
    """Each chain_sum prompt's length in the tiny tokenizer (per character, with BOS), by the row's id."""
    with open(train_file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return {row["id"]: len(row["prompt"]) + 1 for row in rows}


def chain_sum_workload(train_file: str, max_tokens: int, name: str = "chain_sum") -> Workload:
    """The chain_sum task's lengths as the tiny model writes them (the tiny tokenizer is per character):
    each prompt "d+d+...=" with BOS, and its answer's running sums with EOS."""
    prompts, answers = [], []
    with open(train_file, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            prompts.append(len(row["prompt"]) + 1)
            answers.append(min(max_tokens, len(row["answer"]) + 1))
    return Workload(
        name=name, prompt_tokens=round(sum(prompts) / len(prompts)), median_tokens=sorted(answers)[len(answers) // 2],
        sigma=0.0, max_tokens=max_tokens, empirical_groups=tuple((answer,) for answer in answers),
        empirical_prompt_tokens=tuple(prompts),
    )


REASONING_DRIFT = Workload(
    name="reasoning-drift", prompt_tokens=256, median_tokens=1200, sigma=0.9, max_tokens=16_384, drift_per_step=0.01,
)
"""Reasoning RL on a Qwen3-8B-class model: long-tailed responses whose median grows 1% per step."""
