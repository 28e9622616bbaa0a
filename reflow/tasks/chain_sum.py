"""chain_sum: add a chain of single digits, writing every running sum.

    prompt      "3+5+2+8="
    completion  "8,10,18"      (the running sums; the last one is the answer)

The number of terms follows a geometric tail, so the natural completion
length varies widely (2 to ~40 characters), like reasoning traces whose
length depends on the problem. The reward is 1 when the last number equals
the true sum and every running sum is written correctly, 0.5 when only the
final answer is right, and 0 otherwise.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from reflow.tasks.base import Problem
from reflow.tasks.math_verify_reward import MathVerifier, boxed_format_reward, boxed_reward


@dataclass
class ChainSumSpec:
    min_terms: int = 2
    max_terms: int = 14
    tail_p: float = 0.3
    """Geometric parameter: P(n_terms = min_terms + k) ~ (1 - tail_p)^k * tail_p."""


def sample_problem(rng: random.Random, spec: ChainSumSpec, uid: str) -> Problem:
    n = spec.min_terms
    while n < spec.max_terms and rng.random() > spec.tail_p:
        n += 1
    terms = [rng.randint(0, 9) for _ in range(n)]
    sums, total = [], terms[0]
    for t in terms[1:]:
        total += t
        sums.append(str(total))
    return Problem(uid=uid, prompt="+".join(map(str, terms)) + "=", answer=",".join(sums))


def generate(num: int, seed: int, spec: ChainSumSpec | None = None, prefix: str = "cs") -> list[Problem]:
    rng = random.Random(seed)
    spec = spec or ChainSumSpec()
    return [sample_problem(rng, spec, f"{prefix}-{seed}-{i}") for i in range(num)]


def generate_drifting(num: int, seed: int, start: ChainSumSpec, end: ChainSumSpec, prefix: str = "drift") -> list[Problem]:
    """Problems whose chain-length distribution moves from ``start`` to ``end`` along the list (read in file
    order, with task.shuffle = false, the responses get longer as training goes on, as in reasoning RL)."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        frac = i / max(num - 1, 1)
        spec = ChainSumSpec(
            min_terms=round(start.min_terms + frac * (end.min_terms - start.min_terms)),
            max_terms=round(start.max_terms + frac * (end.max_terms - start.max_terms)),
            tail_p=start.tail_p + frac * (end.tail_p - start.tail_p),
        )
        out.append(sample_problem(rng, spec, f"{prefix}-{seed}-{i}"))
    return out


def write_jsonl(problems: list[Problem], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"id": p.uid, "prompt": p.prompt, "answer": p.answer}) + "\n")


class ChainSumTask:
    """Verifier for chain_sum completions."""

    name = "chain_sum"
    environment = None

    def format_prompt(self, problem: Problem) -> str:
        return problem.prompt

    def reward(self, problem: Problem, completion: str) -> float:
        text = completion.strip()
        want = problem.answer.split(",")
        got = text.split(",")
        if not got or not got[-1].strip().isdigit():
            return 0.0
        if [g.strip() for g in got] == want:
            return 1.0
        return 0.5 if got[-1].strip() == want[-1] else 0.0

    def reward_functions(self) -> dict:
        """The parts of a chain_sum answer as rewards of their own (``reward.functions``)."""
        return {"answer": self.answer_reward, "steps": self.steps_reward, "format": self.format_reward}

    @staticmethod
    def answer_reward(problem: Problem, completion: str) -> float:
        """1 when the last number written is the sum."""
        got = completion.strip().split(",")
        return 1.0 if got[-1].strip() == problem.answer.split(",")[-1] else 0.0

    @staticmethod
    def steps_reward(problem: Problem, completion: str) -> float:
        """The share of the running sums written correctly, in place (extra numbers count against it)."""
        want = problem.answer.split(",")
        got = [g.strip() for g in completion.strip().split(",")]
        right = sum(1 for g, w in zip(got, want) if g == w)
        return right / max(len(want), len(got))

    @staticmethod
    def format_reward(problem: Problem, completion: str) -> float:
        """1 when the response is comma-separated numbers and nothing else."""
        got = completion.strip().split(",")
        return 1.0 if all(g.strip().isdigit() for g in got) else 0.0


class ChainSumBoxedTask:
    """chain_sum with the answer written as ``\\boxed{...}`` after the running sums, scored by math-verify:

        prompt      "Box: 3+5+2="
        completion  "8,10\n\\boxed{10}"

    The reward is 1 when the boxed answer equals the sum, else 0 (a missing box scores 0)."""

    name = "chain_sum_boxed"
    environment = None
    PREFIX = "Box: "

    def __init__(self, reward_timeout_s: float = 5.0):
        self.verifier = MathVerifier(reward_timeout_s)

    def format_prompt(self, problem: Problem) -> str:
        return self.PREFIX + problem.prompt

    def reward(self, problem: Problem, completion: str) -> float:
        return boxed_reward(self.verifier, completion, problem.answer.split(",")[-1])

    def reward_functions(self) -> dict:
        """Beside the answer: whether it is boxed at all (``reward.functions``)."""
        return {"boxed": boxed_format_reward}
