"""retool: math with a Python interpreter the model calls while it reasons (ReTool).

    prompt       the problem, with instructions to use the interpreter (a system message for chat rows)
    model        "... <code>\\nprint(2**10 % 7)\\n</code>"        generation stops at "</code>"
    environment  "<interpreter>\\n2\\n</interpreter>\\n"          the sandbox's output (or error), never trained on
    model        "... so the answer is \\boxed{2}."

The code runs in ``reflow.envs.sandbox`` (a separate process under CPU, memory, wall-clock, process, file
and output limits, without network): hostile or broken code gets its error message back, and the rollout
worker goes on. The reward is math-verify's on the text after the last interpreter output (what the model
concluded, not what the code printed): 1 when its boxed answer equals the reference, else 0.
"""

from __future__ import annotations

import re

from reflow.envs.sandbox import Sandbox
from reflow.tasks.base import Problem, with_instructions
from reflow.tasks.math_verify_reward import MathVerifier, boxed_reward

INSTRUCTIONS = (
    "Solve the problem step by step. You may run Python code by writing it between <code> and </code>; "
    "its output will appear between <interpreter> and </interpreter>. Put the final answer in \\boxed{}."
)
CODE = re.compile(r"<code>((?:(?!<code>).)*?)</code>\s*$", re.DOTALL)
"""The code block that ends the transcript (the innermost <code> before the final </code>)."""
FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.DOTALL)


def unfenced(code: str) -> str:
    """A code block's code, without a Markdown fence around it."""
    fenced = FENCE.match(code)
    return fenced.group(1) if fenced else code.strip("\n")


def last_code_block(transcript: str) -> str | None:
    """The code of the ``<code>...</code>`` block that ends the transcript."""
    match = CODE.search(transcript)
    return unfenced(match.group(1)) if match is not None else None


class PythonInterpreter:
    """The environment: runs the code block that ended the model's turn in the sandbox, answers its output."""

    stop = ("</code>",)

    def __init__(self, sandbox: Sandbox, max_turns: int = 4, shown_chars: int = 1024):
        self.sandbox = sandbox
        self.max_turns = max_turns
        self.shown_chars = shown_chars

    def respond(self, problem: Problem, transcript: str) -> str | None:
        code = last_code_block(transcript)
        if code is None:
            return "<interpreter>\nerror: no code\n</interpreter>\n"
        result = self.sandbox.run(code)
        return f"<interpreter>\n{result.message(self.shown_chars).rstrip()}\n</interpreter>\n"


class ReToolTask:
    name = "retool"

    def __init__(self, sandbox: Sandbox, max_turns: int = 4, reward_timeout_s: float = 5.0, instructions: str = ""):
        self.environment = PythonInterpreter(sandbox, max_turns)
        self.verifier = MathVerifier(reward_timeout_s)
        self.instructions = instructions or INSTRUCTIONS

    def format_prompt(self, problem: Problem) -> str | list[dict]:
        return with_instructions(self.instructions, problem)

    def reward(self, problem: Problem, completion: str) -> float:
        conclusion = completion.rsplit("</interpreter>", 1)[-1]
        return boxed_reward(self.verifier, conclusion, problem.answer)
