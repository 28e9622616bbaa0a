"""The task (reward environment) interface.

A task turns dataset rows into prompts and scores completions (``chain_sum``;
``math``, scored by math-verify). Every task implements the same small
protocol; the trainer never looks inside a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One dataset row (``reflow.tasks.datasets`` reads the layouts): an id, the prompt and the reference."""

    uid: str
    prompt: str
    """The problem text (a chat row's last user message)."""
    answer: str
    """The reference answer (a coding row's reference solution, which no reward reads)."""
    messages: tuple[dict, ...] | None = None
    """A chat row's messages, rendered with the tokenizer's chat template; None: ``prompt`` is the text."""
    tests: tuple[tuple[str, str], ...] = ()
    """A coding row's tests: (stdin, expected stdout) pairs; with ``entry_point``, (JSON arguments, JSON result)."""
    entry_point: str = ""
    """A coding row with call-based tests (APPS ``fn_name``): the function (or ``Solution`` method) to call."""
    source: str = ""
    """Where the row came from (verl's data_source, "apps", or the file)."""


class Environment(Protocol):
    """What a multi-turn task talks to between the model's turns (a calculator, a code interpreter, a test
    runner). ``reflow.rollout.turns`` calls it on a worker thread, never inside an engine step."""

    stop: tuple[str, ...]
    """Strings that end a model turn which addresses the environment (the end of a tool call)."""
    max_turns: int
    """Environment answers per trajectory; a model turn past them ends the trajectory unanswered."""

    def respond(self, problem: "Problem", transcript: str) -> str | None:
        """The environment's answer to the latest model turn (``transcript`` is the response so far, the
        model's turns and the earlier answers, ending with one of ``stop``), or None to end the trajectory."""
        ...


@runtime_checkable
class Task(Protocol):
    """What a reward environment provides to the trainer."""

    name: str
    environment: Environment | None
    """None: single-turn (the model's completion is the whole response)."""

    def format_prompt(self, problem: Problem) -> str | list[dict]:
        """What the policy is conditioned on: text, or chat messages (rendered with the chat template)."""
        ...

    def reward(self, problem: Problem, completion: str) -> float:
        """Score one completion in [0, 1] (a multi-turn task's: the whole response, environment answers included)."""
        ...


def with_instructions(instructions: str, problem: Problem) -> str | list[dict]:
    """A prompt with a task's instructions first: a system message before a chat row's messages, or a paragraph
    before a text row's problem."""
    if problem.messages is not None:
        return [{"role": "system", "content": instructions}, *problem.messages]
    return f"{instructions}\n\n{problem.prompt}\n"


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
