"""The task (reward environment) interface.

A task turns dataset rows into prompts and scores completions (``chain_sum``;
``math``, scored by math-verify). Every task implements the same small
protocol; the trainer never looks inside a row.
"""

from __future__ import annotations

import json
import os
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


def load_problems(path: str, key: str = "task.train_file") -> list[Problem]:
    """Read a JSONL file of {"id", "prompt", "answer"} rows. Errors name the config key, the file and the line:
    a missing or empty file, a line that is not UTF-8 or not a JSON object, a row without a non-empty prompt
    (never an empty prompt in silence), or without an answer."""
    problems: list[Problem] = []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ValueError(f"{key}: task data file not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{key}: {path} is a folder, not a JSONL file") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            where = f"{key}: {path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with keys id, prompt, answer, got {type(row).__name__}")
            prompt = row.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{where}: row has no prompt (field 'prompt' must be a non-empty string, got {prompt!r})")
            if "answer" not in row:
                raise ValueError(f"{where}: row has no 'answer' field")
            problems.append(Problem(uid=str(row.get("id", f"{os.path.basename(path)}:{lineno}")), prompt=prompt, answer=str(row["answer"])))
    if not problems:
        raise ValueError(f"{key}: task data file is empty: {path}")
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
