"""GRPO request groups: the G sampling requests of one prompt (seeded per sample and version), a rollout
worker's source of them (``PromptGroups``, a ``GroupSource``), and the held-out evaluation of one rank's share
of the eval prompts."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from reflow.rollout.request import Request
from reflow.rollout.scoring import score
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.tasks.base import Problem, Task

if TYPE_CHECKING:
    from reflow.modes.prompts import PromptShare, PromptStream


def request_seed(job_seed: int, uid: str, sample: int, version: int) -> int:
    """A stable per-sample sampling seed (same run, same samples)."""
    h = hashlib.blake2b(f"{job_seed}/{uid}/{sample}/{version}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def make_group_requests(
    problem: Problem, draw: int, task: Task, tok: PromptTokenizer, group_size: int, max_tokens: int, job_seed: int, version: int
) -> list[Request]:
    """G sample-level requests for one prompt; they travel (and are scored) together.

    ``draw`` is the prompt's position in the run's prompt stream: unique even when a problem is drawn twice."""
    ids = tok.encode_prompt(task.format_prompt(problem))
    group = f"{problem.uid}#{draw}"
    return [
        Request(
            request_id=f"{group}/{k}",
            prompt_ids=ids,
            max_tokens=max_tokens,
            seed=request_seed(job_seed, group, k, version),
            meta={"problem": problem, "group": group, "draw": draw},
        )
        for k in range(group_size)
    ]


class PromptGroups:
    """A rollout worker's groups, live: its share of the run's prompt stream, each draw's problem formatted and
    tokenized by the task, G requests seeded by the version they start under."""

    def __init__(
        self, stream: "PromptStream", share: "PromptShare", task: Task, tokenizer: PromptTokenizer, group_size: int,
        max_tokens: int, job_seed: int,
    ):
        self.stream, self.share, self.task, self.tokenizer = stream, share, task, tokenizer
        self.group_size, self.max_tokens, self.job_seed = group_size, max_tokens, job_seed

    def peek(self) -> int:
        return self.share.peek()

    def take(self) -> int:
        return self.share.take()

    def requests(self, draw: int, version: int) -> list[Request]:
        return make_group_requests(
            self.stream.problem_at(draw), draw, self.task, self.tokenizer, self.group_size, self.max_tokens,
            self.job_seed, version,
        )


def evaluate_share(parts, turns, num_prompts: int, index: int, count: int) -> tuple[float, int]:
    """Share ``index`` of ``count`` of the first ``num_prompts`` held-out prompts, one sample each on this rank's
    engine, run to completion through ``turns`` (a ``TurnDriver`` holding nothing else): (sum of rewards,
    samples)."""
    problems = parts.eval_problems[:num_prompts][index::count]
    requests = []
    for problem in problems:
        requests.extend(make_group_requests(
            problem, -1, parts.task, parts.tokenizer, 1, parts.cfg.rollout.max_new_tokens, parts.cfg.job.seed, -1,
        ))
    samples = score(turns.generate(requests), parts.task, parts.tokenizer) if requests else []
    return sum(s.reward for s in samples), len(samples)
