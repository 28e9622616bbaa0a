"""The task (reward environment) interface.

A task turns dataset rows into prompts and scores completions. Later tasks
(math with a symbolic verifier, multi-turn tool environments) implement the
same small protocol; the trainer never looks inside a row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One dataset row: an id, the prompt text and the reference answer."""

    uid: str
    prompt: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """What a reward environment provides to the trainer."""

    name: str

    def format_prompt(self, problem: Problem) -> str:
        """The text the policy is conditioned on."""
        ...

    def reward(self, problem: Problem, completion: str) -> float:
        """Score one completion in [0, 1]."""
        ...


def load_problems(path: str) -> list[Problem]:
    """Read a JSONL file of {"id", "prompt", "answer"} rows; errors name the file and line."""
    problems: list[Problem] = []
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"task data file not found: {path} (set task.train_file / task.eval_file)") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(Problem(uid=str(row["id"]), prompt=str(row["prompt"]), answer=str(row["answer"])))
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: bad task row ({e!r}); expected keys id, prompt, answer") from None
    if not problems:
        raise ValueError(f"task data file is empty: {path}")
    return problems


def epoch_order(num_problems: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The problems' order in one epoch of the run's stream: a seeded permutation per epoch, or the file's
    order (task.shuffle = false: a curriculum, or a workload that drifts)."""
    import random

    order = list(range(num_problems))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def iterate_epochs(problems: list[Problem], seed: int, shuffle: bool = True) -> Iterator[Problem]:
    """Endless deterministic stream, epoch after epoch (``epoch_order``)."""
    epoch = 0
    while True:
        for i in epoch_order(len(problems), seed, epoch, shuffle):
            yield problems[i]
        epoch += 1
