"""agent: an agent written against the OpenAI API is the environment (``task.agent = "module:function"``).

    async def my_agent(client: openai.AsyncOpenAI, row: dict) -> float | dict[str, float]:
        out = await client.chat.completions.create(model=row["model"], messages=[...], tools=[...])
        ...                                   # its own tool loop: call tools, send their results back
        return reward                         # or {"task": ..., "format": ...} for a [reward] mix

Each episode is one run of the function: ``client`` is pointed at the run's endpoint for that episode alone
(``reflow.serving.agents``), ``row`` is the prompt's dataset row (``id``, ``prompt``, ``answer``, ``messages``,
``source``) and the served model's name (``model``). Every call of the episode is one trajectory; a group of
``training.group_size`` episodes of one prompt is a GRPO group. The function runs under
``task.agent_timeout_s`` and ``task.max_turns`` calls; see ``docs/agents.md``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any, Callable

from reflow.tasks.base import Problem


def load_agent(spec: str) -> Callable:
    """``module:function`` -> the coroutine function; a ValueError naming task.agent says what is wrong."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"task.agent = {spec!r}: write it as 'module:function' (an importable module)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"task.agent = {spec!r}: cannot import {module_name!r}: {error}") from None
    function = getattr(module, attribute, None)
    if function is None:
        raise ValueError(f"task.agent = {spec!r}: module {module_name!r} has no {attribute!r}")
    if not inspect.iscoroutinefunction(function):
        raise ValueError(f"task.agent = {spec!r}: {attribute} must be an async function (client, row) -> reward")
    return function


def agent_row(problem: Problem, model: str) -> dict[str, Any]:
    return {
        "id": problem.uid, "prompt": problem.prompt, "answer": problem.answer,
        "messages": [dict(m) for m in problem.messages] if problem.messages is not None else None,
        "source": problem.source, "model": model,
    }


class AgentTask:
    name = "agent"
    environment = None
    """(The agent is the environment: ``reflow.serving.agents`` drives it.)"""

    def __init__(self, spec: str, timeout_s: float, max_turns: int):
        self.spec = spec
        self.agent = load_agent(spec)
        self.timeout_s = timeout_s
        self.max_turns = max_turns

    def format_prompt(self, problem: Problem) -> str | list[dict]:
        """The row's own prompt: an estimate of the first call's, for admission (the agent writes its own)."""
        return list(problem.messages) if problem.messages is not None else problem.prompt

    def reward(self, problem: Problem, completion: str) -> float:
        raise RuntimeError("an agent task's reward is what its agent returns (reflow.serving.agents)")

    async def run_episode(self, base_url: str, api_key: str, row: dict, http_client=None) -> Any:
        """One episode: the agent with a client of its own at ``base_url`` (over ``http_client`` when given),
        under the time limit; the client closed after. Runs in the agents' process
        (``reflow.serving.agent_host``)."""
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s,
                                    http_client=http_client)
        try:
            return await asyncio.wait_for(self.agent(client, row), self.timeout_s)
        finally:
            await client.close()
