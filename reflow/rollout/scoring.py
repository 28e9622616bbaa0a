"""Scoring finished trajectories: the one reward path, and the advantage estimator's group stage.

``trajectory_reward`` is the only place a reward is computed: ``reflow.rollout.turns`` calls it for a
multi-turn trajectory (on its tool pool, when the trajectory ends), ``score`` for a single-turn one. With a
``RewardMix`` (``reflow.rewards``: the run's weighted reward functions and overlong shaping) it is the mix,
its parts kept on the sample; without one (the held-out evaluation) the task's own reward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from reflow.algorithms.advantages import AdvantageEstimator
from reflow.tasks.base import Task
from reflow.types import Sample

if TYPE_CHECKING:
    from reflow.rewards import RewardMix
    from reflow.rollout.request import Request
    from reflow.rollout.tokenizer import PromptTokenizer


def trajectory_reward(task: Task, tok: "PromptTokenizer", req: "Request", rewards: "RewardMix | None" = None) -> None:
    """Set ``req.reward`` (and ``req.reward_parts`` with a mix) from the trajectory's transcript: its whole
    response, the environment's answers included."""
    text = tok.decode(req.output_ids)
    if rewards is None:
        req.reward = task.reward(req.meta["problem"], text)
    else:
        req.reward, req.reward_parts = rewards.score(req.meta["problem"], text, len(req.output_ids))


def score(requests: list[Request], task: Task, tok: PromptTokenizer, rewards: "RewardMix | None" = None) -> list[Sample]:
    out = []
    for r in requests:
        if r.reward is None:
            trajectory_reward(task, tok, r, rewards)
        out.append(
            Sample(
                uid=r.request_id,
                draw=r.meta["draw"],
                group_id=r.meta["group"],
                prompt_ids=r.prompt_ids,
                output_ids=r.output_ids,
                logprobs=r.logprobs,
                versions=r.versions,
                reward=r.reward,
                reward_parts=r.reward_parts,
                finish_reason=r.finish_reason,
                # (spans only where the environment added tokens: every token of a single-turn response is the model's)
                model_spans=r.model_spans if len(r.logprobs) < len(r.output_ids) else None,
                tool_calls=r.tool_calls,
                tool_s=r.tool_s,
                agent_failure=r.meta.get("agent_failure", ""),
                token_mismatches=r.meta.get("token_mismatches", 0),
            )
        )
    return out


class TaskScorer:
    """A finished group scored by the run's reward (``score``) with the estimator's group-stage advantages (a
    ``GroupScorer``)."""

    def __init__(
        self, task: Task, tokenizer: "PromptTokenizer", estimator: AdvantageEstimator, rewards: "RewardMix | None" = None
    ):
        self.task, self.tokenizer, self.estimator, self.rewards = task, tokenizer, estimator, rewards

    def score(self, members: "list[Request]") -> list[Sample]:
        samples = score(members, self.task, self.tokenizer, self.rewards)
        assign_advantages(samples, self.estimator)
        return samples


def assign_advantages(samples: list[Sample], estimator: AdvantageEstimator) -> None:
    """The estimator's group stage within each group (a group's samples are all present); also each group's
    mean reward. REINFORCE++'s batch stage follows on the trainer (``reflow.modes.base``)."""
    if not samples:
        return
    groups = {g: i for i, g in enumerate(dict.fromkeys(s.group_id for s in samples))}
    rewards = torch.tensor([s.reward for s in samples])
    gids = torch.tensor([groups[s.group_id] for s in samples])
    adv = estimator.group_stage(rewards, gids)
    means = {g: rewards[gids == i].mean().item() for g, i in groups.items()}
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
        s.group_reward_mean = means[s.group_id]
