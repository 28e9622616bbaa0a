"""Tasks (reward environments). Chosen by ``task.name`` from this explicit dict."""

from reflow.tasks.base import Problem, Task, iterate_epochs, load_problems
from reflow.tasks.chain_sum import ChainSumTask

TASKS: dict[str, type] = {
    "chain_sum": ChainSumTask,
}


def build_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r} (known: {', '.join(TASKS)})")
    return TASKS[name]()


__all__ = ["Problem", "Task", "TASKS", "build_task", "iterate_epochs", "load_problems"]
