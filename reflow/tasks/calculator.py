"""chain_sum_calculator: long chain sums, with a calculator the model may call.

    prompt      "Calc: 3+5+2+8+...="
    completion  "<calc>3+5+2+8+...</calc>"        a tool call: generation stops at "</calc>"
    environment "<result>18</result>\\n"            appended by the calculator, never trained on
    completion  "\\boxed{18}"                       the model goes on, and answers

The model may also answer directly (the running sums, then the boxed total), which a tiny model gets wrong
more often the longer the chain. The reward is 1 when math-verify finds the boxed answer equal to the sum,
else 0 (no boxed answer: 0). RL can raise it by calling the calculator more often and copying the chain
into the call, and the result out of it, more faithfully: the mechanism of tool-integrated reasoning
(ReTool) at the scale of a CPU test.
"""

from __future__ import annotations

import ast
import operator
import re

from reflow.tasks.base import Problem
from reflow.tasks.math_verify_reward import MathVerifier, boxed_reward

CALL = re.compile(r"<calc>((?:(?!<calc>).)*?)</calc>\s*$", re.DOTALL)
"""The call that ends the transcript (the innermost <calc> before the final </calc>)."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str, max_chars: int = 256, max_abs: int = 10**12) -> int:
    """Integer arithmetic (+, -, *, parentheses) without eval; ValueError names what is wrong."""
    if len(expression) > max_chars:
        raise ValueError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            result = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(result) > max_abs:
                raise ValueError("result too large")
            return result
        raise ValueError(f"unsupported element {type(node).__name__}")

    return value(tree.body)


class Calculator:
    """The environment: answers the latest ``<calc>...</calc>`` call."""

    stop = ("</calc>",)

    def __init__(self, max_turns: int = 2):
        self.max_turns = max_turns

    def respond(self, problem: Problem, transcript: str) -> str | None:
        call = CALL.search(transcript)
        if call is None:
            return "<result>error: no expression</result>\n"
        try:
            return f"<result>{evaluate(call.group(1))}</result>\n"
        except ValueError as e:
            return f"<result>error: {e}</result>\n"


class ChainSumCalculatorTask:
    name = "chain_sum_calculator"
    PREFIX = "Calc: "

    def __init__(self, max_turns: int = 2, reward_timeout_s: float = 5.0):
        self.environment = Calculator(max_turns)
        self.verifier = MathVerifier(reward_timeout_s)

    def format_prompt(self, problem: Problem) -> str:
        return self.PREFIX + problem.prompt

    def reward(self, problem: Problem, completion: str) -> float:
        return boxed_reward(self.verifier, completion, problem.answer.split(",")[-1])
