"""Advantage estimators: one scalar advantage per sample from the rewards of its group (and, for REINFORCE++,
of its batch). Selected by ``advantage.estimator``.

Every estimator runs in two stages, because groups finish one at a time in a decoupled run while a batch
exists only on the trainer:

  1. ``group_stage``  when a group finishes (``reflow.rollout.scoring``), from the group's rewards alone;
  2. ``batch_stage``  when the group's samples are first trained, over the step's fresh samples on every
                      trainer rank (REINFORCE++ only; the identity for the others).

A sample keeps the advantage it has after its first training: a replayed sample is trained on the advantage
computed with the group (and batch) it was generated in, never recomputed against a later policy's samples.

The full estimators (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``) are the two stages composed, written
out for the hand-computed tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reflow.algorithms.names import ESTIMATORS, check_choice


def _per_group(rewards: torch.Tensor, group_ids: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` on each group's rewards, in float64: a group of equal rewards that are not exact in binary (2/3,
    a weighted mix's 0.85) must centre to 0, and float32's mean is an ulp off, which GRPO's std would then
    blow up to a spurious advantage."""
    out = torch.empty_like(rewards, dtype=torch.float64)
    for group in torch.unique(group_ids):
        members = group_ids == group
        out[members] = fn(rewards[members].double())
    return out.float()


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, eq. 3): A_i = (r_i - mean_g) / (std_g + eps), with the group's
    population standard deviation. A group whose rewards are all equal gets 0. (N,) -> (N,)"""
    return _per_group(rewards, group_ids, lambda r: (r - r.mean()) / (r.std(unbiased=False) + eps))


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 3): A_i = r_i - mean_g, without
    the std, which weights easy and hard prompts unevenly. Its other half, no length normalization, is the
    loss aggregation ``token_sum_norm``."""
    return _per_group(rewards, group_ids, lambda r: r - r.mean())


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", eq. 8; Kool et al. 2019): the leave-one-out baseline,
    A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j = G / (G - 1) (r_i - mean_g). Needs G >= 2."""

    def leave_one_out(r: torch.Tensor) -> torch.Tensor:
        size = r.numel()
        if size < 2:
            raise ValueError("RLOO needs at least two samples per group")
        return r - (r.sum() - r) / (size - 1)

    return _per_group(rewards, group_ids, leave_one_out)


def whiten(values: torch.Tensor, mean: float, std: float, eps: float = 1e-6) -> torch.Tensor:
    """(v - mean) / (std + eps), with the batch's statistics given (a batch spread over ranks)."""
    return ((values.double() - mean) / (std + eps)).float()


def reinforce_pp(
    rewards: torch.Tensor, group_ids: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, "REINFORCE++", eq. 9): the batch-normalized reward,
    A_i = (r_i - mean_B) / (std_B + eps) over the whole batch (population std). With ``group_ids``,
    REINFORCE++-baseline: the group mean is subtracted first, A_i = whiten_B(r_i - mean_g)."""
    centred = (dr_grpo(rewards, group_ids) if group_ids is not None else rewards).double()
    return whiten(centred, centred.mean().item(), centred.std(unbiased=False).item(), eps)


@dataclass(frozen=True)
class AdvantageEstimator:
    """The estimator a run uses, split into its two stages (module docstring)."""

    name: str = "grpo"
    eps: float = 1e-6
    group_baseline: bool = True
    """REINFORCE++ only: subtract the group mean before the batch normalization (REINFORCE++-baseline)."""

    def __post_init__(self):
        check_choice("advantage estimator", self.name, ESTIMATORS)

    def group_stage(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        if self.name == "grpo":
            return grpo(rewards, group_ids, self.eps)
        if self.name == "dr_grpo":
            return dr_grpo(rewards, group_ids)
        if self.name == "rloo":
            return rloo(rewards, group_ids)
        return dr_grpo(rewards, group_ids) if self.group_baseline else rewards.float()

    @property
    def normalizes_batch(self) -> bool:
        """Whether ``batch_stage`` does anything (the trainer then reduces the batch's statistics)."""
        return self.name == "reinforce_pp"

    def batch_stage(self, advantages: torch.Tensor, mean: float, std: float) -> torch.Tensor:
        """The group-stage advantages of a step's fresh samples, given their mean and std over every rank."""
        return whiten(advantages, mean, std, self.eps) if self.normalizes_batch else advantages
