"""A sample's reward: the task's reward functions, weighted, plus DAPO's overlong shaping.

    reward = sum_k weight_k * f_k(problem, response)  -  overlong_penalty * |R_length(response tokens)|

``reward.functions`` names the functions: 'task' is the task's own ``reward``; a task may offer more
through ``reward_functions()`` (name -> function of the problem and the response text), such as
chain_sum's 'answer', 'steps' and 'format'. Every part is kept on the sample (``Sample.reward_parts``) and
logged per step as ``reward_<name>_mean`` (the shaping as ``reward_overlong_mean``). The held-out evaluation
scores with the task's own reward, so runs with different mixes compare on one scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from reflow.algorithms.shaping import overlong_penalty
from reflow.tasks.base import Problem, Task

RewardFunction = Callable[[Problem, str], float]


def available_functions(task: Task) -> dict[str, RewardFunction]:
    """The reward functions a task offers, by name: 'task' and whatever its ``reward_functions`` adds."""
    offered = dict(task.reward_functions()) if hasattr(task, "reward_functions") else {}
    return {"task": task.reward, **offered}


@dataclass
class RewardMix:
    """The reward of the ``[reward]`` section for one task."""

    functions: dict[str, RewardFunction]
    weights: dict[str, float]
    max_tokens: int
    overlong_buffer: int = 0
    overlong_scale: float = 1.0

    @classmethod
    def build(cls, task: Task, section, max_tokens: int) -> "RewardMix":
        """From ``reward`` (a ``RewardSection``); an unknown function name is a ValueError naming the key."""
        offered = available_functions(task)
        unknown = [name for name in section.functions if name not in offered]
        if task.name == "agent":  # its agent returns the rewards by name (``combine``); none is computed here
            offered = {name: offered.get(name, task.reward) for name in section.functions}
        elif unknown:
            raise ValueError(
                f"reward.functions: {', '.join(map(repr, unknown))} not offered by task {task.name!r} "
                f"(it offers: {', '.join(offered)})"
            )
        weights = section.weights or [1.0] * len(section.functions)
        return cls(
            {name: offered[name] for name in section.functions}, dict(zip(section.functions, weights)), max_tokens,
            section.overlong_buffer, section.overlong_penalty,
        )

    @property
    def part_names(self) -> list[str]:
        """Every part a sample's ``reward_parts`` holds."""
        return list(self.functions) + (["overlong"] if self.overlong_buffer > 0 else [])

    def score(self, problem: Problem, response: str, response_tokens: int) -> tuple[float, dict[str, float]]:
        """(the reward, each part before its weight: the functions' values and the overlong term).
        ``response_tokens``: every token of the response, the environment's included, as the length cap
        (rollout.max_new_tokens) counts them."""
        return self.combine({name: function(problem, response) for name, function in self.functions.items()},
                            response_tokens)

    def combine(self, values: dict[str, float], response_tokens: int) -> tuple[float, dict[str, float]]:
        """``score`` for rewards computed elsewhere (an agent's, by name): every function of the mix must be in
        ``values`` (a ValueError names the missing ones)."""
        missing = [name for name in self.functions if name not in values]
        if missing:
            raise ValueError(f"reward.functions {missing} missing from the rewards {sorted(values)}")
        parts = {name: float(values[name]) for name in self.functions}
        total = sum(self.weights[name] * value for name, value in parts.items())
        if self.overlong_buffer > 0:
            parts["overlong"] = self.overlong_scale * overlong_penalty(response_tokens, self.max_tokens, self.overlong_buffer)
            total += parts["overlong"]
        return total, parts


def outcome_reward(sample) -> float:
    """A sample's reward without the overlong shaping: what DAPO's dynamic sampling asks to differ within a
    group (its accuracy), so a group of wrong answers is not kept for a length penalty alone."""
    return sample.reward - (sample.reward_parts or {}).get("overlong", 0.0)
