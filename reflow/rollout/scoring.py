"""Scoring finished trajectories: the one reward path, and GRPO's group advantages.

``trajectory_reward`` is the only place a task's reward is computed: ``reflow.rollout.turns`` calls it for a
multi-turn trajectory (on its tool pool, when the trajectory ends), ``score`` for a single-turn one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from reflow.algorithms.grpo import group_advantages
from reflow.tasks.base import Task
from reflow.types import Sample

if TYPE_CHECKING:
    from reflow.rollout.request import Request
    from reflow.rollout.tokenizer import PromptTokenizer


def trajectory_reward(task: Task, tok: "PromptTokenizer", req: "Request") -> float:
    """The task's reward of a trajectory's transcript: its whole response, the environment's answers included."""
    return task.reward(req.meta["problem"], tok.decode(req.output_ids))


def score(requests: list[Request], task: Task, tok: PromptTokenizer) -> list[Sample]:
    out = []
    for r in requests:
        out.append(
            Sample(
                uid=r.request_id,
                draw=r.meta["draw"],
                group_id=r.meta["group"],
                prompt_ids=r.prompt_ids,
                output_ids=r.output_ids,
                logprobs=r.logprobs,
                versions=r.versions,
                reward=r.reward if r.reward is not None else trajectory_reward(task, tok, r),
                finish_reason=r.finish_reason,
                model_spans=r.model_spans if task.environment is not None else None,
                tool_calls=r.tool_calls,
                tool_s=r.tool_s,
            )
        )
    return out


class TaskScorer:
    """A finished group scored by the task's reward (``score``) with GRPO's advantages (a ``GroupScorer``)."""

    def __init__(self, task: Task, tokenizer: "PromptTokenizer", normalize_std: bool, eps: float):
        self.task, self.tokenizer, self.normalize_std, self.eps = task, tokenizer, normalize_std, eps

    def score(self, members: "list[Request]") -> list[Sample]:
        samples = score(members, self.task, self.tokenizer)
        assign_advantages(samples, self.normalize_std, self.eps)
        return samples


def assign_advantages(samples: list[Sample], normalize_std: bool, eps: float) -> None:
    """GRPO advantages within each group (a group's samples are all present); also each group's mean reward."""
    if not samples:
        return
    groups = {g: i for i, g in enumerate(dict.fromkeys(s.group_id for s in samples))}
    rewards = torch.tensor([s.reward for s in samples])
    gids = torch.tensor([groups[s.group_id] for s in samples])
    adv = group_advantages(rewards, gids, normalize_std, eps)
    means = {g: rewards[gids == i].mean().item() for g, i in groups.items()}
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
        s.group_reward_mean = means[s.group_id]
