"""KL to the frozen reference policy: three estimators, in the loss or in the reward. Selected by ``kl``.

With d_t = logp_ref(y_t) - logp_new(y_t) on a token sampled from the policy (Schulman 2020, "Approximating
KL Divergence"), each estimates KL(new || ref) per token:

    k1 = -d                    unbiased, high variance, can be negative
    k2 = d^2 / 2               biased, low variance, always >= 0
    k3 = exp(d) - d - 1        unbiased, low variance, always >= 0 (GRPO's, DeepSeekMath eq. 4)

``in_loss``: beta k_t is added to each token's loss (GRPO), with its gradient. ``in_reward``: the detached
-beta k_t is a per-token reward (Ziegler et al. 2019; Ouyang et al. 2022; REINFORCE++), so token t's
advantage becomes A_i - beta sum_{s >= t} k_s (the penalty's return-to-go, no discount), with k from the
log-probs at the start of the step, so every update of the step has the same target. The reference
log-probs exist only on the trainer, so the reward form shapes the advantage there, after the group (and
batch) normalization the task's reward went through (REINFORCE++ shapes the reward before normalizing).
"""

from __future__ import annotations

import torch

from reflow.algorithms.names import KL_ESTIMATORS, check_choice


def kl_estimate(logp_new: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(new || ref) estimate, (B, T), with gradients through ``logp_new``."""
    check_choice("KL estimator", estimator, KL_ESTIMATORS)
    d = logp_ref - logp_new
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(d) - d - 1.0


def reward_to_go(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_{s >= t} m_s x_s for every t (undiscounted return of a per-token reward). (B, T) -> (B, T)"""
    masked = per_token * mask
    return masked.flip(-1).cumsum(-1).flip(-1)


def kl_shaped_advantages(
    advantages: torch.Tensor, logp_policy: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, coef: float,
    estimator: str = "k3",
) -> torch.Tensor:
    """A_it = A_i - beta sum_{s >= t} k_s with k detached: the KL penalty as a per-token reward, k of
    ``logp_policy`` (the trainer passes the step-start log-probs) against the reference. (B,) -> (B, T)"""
    penalty = kl_estimate(logp_policy.detach(), logp_ref, estimator)
    return advantages[:, None] - coef * reward_to_go(penalty, mask)
