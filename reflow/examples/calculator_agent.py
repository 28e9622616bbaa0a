"""The tiny ReTool task (``chain_sum_calculator``) written as an agent against the OpenAI API.

    [task]
    name = "agent"
    agent = "reflow.examples.calculator_agent:solve"

The agent owns its tool loop: it asks the policy for a completion of the problem, which stops at the end of a
calculator call (``</calc>``); it evaluates the call with its calculator tool and sends the conversation back
with the result, until the policy answers. Its reward is the built-in task's: 1 when the boxed answer is the
chain's sum.

The tiny policy was fine-tuned on this text format ("Calc: 3+5=", "<calc>3+5</calc>", "<result>8</result>"),
not on a chat template's tool calls, so the agent talks to it through ``client.completions``. An agent for an
instruction-tuned model (Qwen3) would pass the calculator as an OpenAI tool to ``client.chat.completions``
and read ``message.tool_calls`` instead; docs/agents.md shows that form.
"""

from __future__ import annotations

import asyncio
import re

from reflow.tasks.base import Problem
from reflow.tasks.calculator import ChainSumCalculatorTask, evaluate

STOP = "</calc>"
CALL = re.compile(r"<calc>((?:(?!<calc>).)*)$", re.DOTALL)
TASK = ChainSumCalculatorTask()
"""The built-in task, for its prompt format and its reward (math-verify on the boxed answer)."""


def calculator(expression: str) -> str:
    """The tool: integer arithmetic, or the error as text."""
    try:
        return str(evaluate(expression))
    except ValueError as error:
        return f"error: {error}"


async def solve(client, row: dict, max_tokens: int = 160, max_calls: int = 2) -> float:
    """One episode: at most ``max_calls`` calculator calls answered (a call past them ends the answer, as in the
    built-in task); ``max_tokens`` per completion (the run caps each at what its trajectory has left)."""
    problem = Problem(row["id"], row["prompt"], row["answer"])
    prompt = TASK.format_prompt(problem)
    transcript = ""
    for calls in range(max_calls + 1):
        out = await client.completions.create(model=row["model"], prompt=prompt + transcript, stop=[STOP],
                                              max_tokens=max_tokens)
        choice = out.choices[0]
        transcript += choice.text
        # a call ends at the stop string; vLLM's stop_reason (which this endpoint sends too) tells it from an EOS
        called = CALL.search(choice.text) if (choice.model_extra or {}).get("stop_reason") == STOP else None
        if called is None or calls == max_calls:
            break
        transcript += f"{STOP}<result>{calculator(called.group(1))}</result>\n"
    # the reward runs math-verify in a subprocess: off the event loop, which every episode shares
    return await asyncio.to_thread(TASK.reward, problem, transcript)
