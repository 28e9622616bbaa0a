"""Tasks (reward environments). Chosen by ``task.name`` from this explicit dict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from reflow.tasks.base import Environment, Problem, Task, iterate_epochs
from reflow.tasks.datasets import load_problems

if TYPE_CHECKING:
    from reflow.config.job_config import TaskSection


def _sandbox(section: "TaskSection"):
    """The task's sandbox, fail-closed: without the kernel boundary (and no opt-out) one line says what is
    missing, before any rank starts (``reflow.train --check`` builds the task)."""
    from reflow.envs.isolation import OPT_OUT
    from reflow.envs.sandbox import NoCgroup, Sandbox, SandboxLimits, SandboxUnavailable

    limits = SandboxLimits(wall_s=section.sandbox_wall_s, cpu_s=section.sandbox_cpu_s, memory_mb=section.sandbox_memory_mb)
    try:
        return Sandbox(limits, allow_unisolated=section.sandbox_allow_unisolated, python=section.sandbox_python,
                       allow_without_cgroup=section.sandbox_allow_without_cgroup)
    except NoCgroup as error:
        raise NoCgroup(f"task.name = {section.name!r} runs model-written code in a sandbox: {error}") from None
    except SandboxUnavailable as error:
        raise SandboxUnavailable(f"task.name = {section.name!r} runs model-written code in a sandbox: {error} "
                                 f"({OPT_OUT})") from None


def _chain_sum(section):
    from reflow.tasks.chain_sum import ChainSumTask

    return ChainSumTask()


def _chain_sum_boxed(section):
    from reflow.tasks.chain_sum import ChainSumBoxedTask

    return ChainSumBoxedTask(section.reward_timeout_s)


def _chain_sum_calculator(section):
    from reflow.tasks.calculator import ChainSumCalculatorTask

    return ChainSumCalculatorTask(section.max_turns, section.reward_timeout_s)


def _math(section):
    from reflow.tasks.math import MathTask

    return MathTask(section.reward_timeout_s)


def _retool(section):
    from reflow.tasks.retool import ReToolTask

    return ReToolTask(_sandbox(section), section.max_turns, section.reward_timeout_s, section.instructions)


def _agent(section):
    from reflow.tasks.agent import AgentTask

    return AgentTask(section.agent, section.agent_timeout_s, section.max_turns)


def _coding_agent(section):
    from reflow.tasks.coding import CodingAgentTask

    return CodingAgentTask(_sandbox(section), section.max_turns, section.instructions)


TASKS: dict[str, Callable[["TaskSection"], Task]] = {
    "chain_sum": _chain_sum,
    "chain_sum_boxed": _chain_sum_boxed,
    "chain_sum_calculator": _chain_sum_calculator,
    "math": _math,
    "retool": _retool,
    "coding_agent": _coding_agent,
    "agent": _agent,
}
"""Each task built from the [task] section (timeouts, turn limit, sandbox limits)."""


def build_task(section: "TaskSection") -> Task:
    if section.name not in TASKS:
        raise ValueError(f"task.name: unknown task {section.name!r} (known: {', '.join(TASKS)})")
    return TASKS[section.name](section)


__all__ = ["Environment", "Problem", "Task", "TASKS", "build_task", "iterate_epochs", "load_problems"]
