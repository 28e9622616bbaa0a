"""math: single-turn math problems (DAPO-Math, GSM8K, MATH style), rewarded by math-verify.

    prompt      the problem as the data file gives it (ask for the answer in \\boxed{} there)
    reward      1 when the completion's answer (its \\boxed{...} first) is equivalent to the reference answer,
                else 0 (``reflow.tasks.math_verify_reward``: out of process, under task.reward_timeout_s)
"""

from __future__ import annotations

from reflow.tasks.base import Problem
from reflow.tasks.math_verify_reward import MathVerifier, boxed_format_reward


class MathTask:
    name = "math"
    environment = None

    def __init__(self, reward_timeout_s: float = 5.0):
        self.verifier = MathVerifier(reward_timeout_s)

    def format_prompt(self, problem: Problem) -> str | list[dict]:
        return list(problem.messages) if problem.messages is not None else problem.prompt

    def reward(self, problem: Problem, completion: str) -> float:
        return self.verifier.score(completion, problem.answer)

    def reward_functions(self) -> dict:
        """Beside the answer: whether it is boxed at all (``reward.functions``)."""
        return {"boxed": boxed_format_reward}
