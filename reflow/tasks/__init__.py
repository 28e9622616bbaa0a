"""Tasks (reward environments). Chosen by ``task.name`` from this explicit dict."""

from reflow.tasks.base import Problem, Task, iterate_epochs, load_problems
from typing import Callable

from reflow.tasks.chain_sum import ChainSumTask
from reflow.tasks.math import MathTask

TASKS: dict[str, Callable[[float], Task]] = {
    "chain_sum": lambda reward_timeout_s: ChainSumTask(),
    "math": lambda reward_timeout_s: MathTask(reward_timeout_s),
}
"""Each task from task.reward_timeout_s (the longest one reward may take, for tasks that can stall on a completion)."""


def build_task(name: str, reward_timeout_s: float = 5.0) -> Task:
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r} (known: {', '.join(TASKS)})")
    return TASKS[name](reward_timeout_s)


__all__ = ["Problem", "Task", "TASKS", "build_task", "iterate_epochs", "load_problems"]
