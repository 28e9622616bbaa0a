"""Policy losses: the per-token loss l_it whose aggregation (``reflow.algorithms.aggregation``) the trainer
minimizes. Selected by ``loss.policy``.

Each takes the trainer's log-probs under the weights being updated (``logp_new``, with gradients) and at the
start of the step (``logp_old``, the PPO "old" policy; equal to ``logp_new`` detached when a batch gets one
update), the advantages (per sample (B,) or per token (B, T)) and the loss mask, and returns the per-token
loss and which tokens the clip held. The ratio r_it = exp(logp_new - logp_old) is against the trainer's own
log-probs; the correction against the engine's behaviour log-probs is separate (``off_policy``) and
multiplies the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reflow.algorithms.names import POLICY_LOSSES, check_choice


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    """(B, T) per-token loss, with gradients."""
    clipped: torch.Tensor
    """(B, T) 1.0 where the clip (or the dual clip) held the token's gradient, detached."""


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def ppo_clip(
    logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> PolicyLoss:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric bounds ("clip-higher", Yu et al.
    2025, DAPO eq. 10): l_it = -min(r_it A_it, clip(r_it, 1 - eps_low, 1 + eps_high) A_it)."""
    adv = _per_token(advantages, logp_new)
    ratio = torch.exp(logp_new - logp_old)
    bounded = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped, clipped = ratio * adv, bounded * adv
    return PolicyLoss(-torch.minimum(unclipped, clipped), (unclipped > clipped).float().detach())


def dual_clip(
    logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
    clip_c: float,
) -> PolicyLoss:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5): for a
    negative advantage the objective is also bounded below by c A_it (c > 1), so a token the old policy
    found unlikely and the new one likely cannot push an unbounded ratio into the gradient:
    l_it = -min(r A, clip(r) A) where A >= 0, and min(-min(r A, clip(r) A), -c A) where A < 0."""
    adv = _per_token(advantages, logp_new)
    clip = ppo_clip(logp_new, logp_old, adv, clip_low, clip_high)
    floor = -clip_c * adv
    dual = (adv < 0) & (clip.loss > floor)
    loss = torch.where(dual, torch.minimum(clip.loss, floor), clip.loss)
    return PolicyLoss(loss, torch.maximum(clip.clipped, dual.float()).detach())


def sequence_log_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(1 / |y_i|) sum_t m_it (logp_new - logp_old): the log of GSPO's length-normalized sequence ratio. (B,)"""
    return ((logp_new - logp_old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def gspo(
    logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float, clip_high: float,
) -> PolicyLoss:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7 and the GSPO-token form,
    eq. 13): the ratio is the sequence's, length-normalized, s_i = exp((1 / |y_i|) sum_t log(pi_new / pi_old)),
    clipped to its own (much narrower) range. In token form s_it = sg[s_i] pi_new(y_t) / sg[pi_new(y_t)],
    numerically s_i with the gradient s_i grad log pi_new(y_t), and l_it = -min(s_it A_it, clip(s_it) A_it).
    Aggregated by ``seq_mean_token_mean`` with A_it = A_i this is exactly GSPO's objective."""
    adv = _per_token(advantages, logp_new)
    log_s = sequence_log_ratio(logp_new, logp_old, mask).detach()
    ratio = torch.exp(logp_new - logp_new.detach() + log_s[:, None])
    bounded = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped, clipped = ratio * adv, bounded * adv
    return PolicyLoss(-torch.minimum(unclipped, clipped), (unclipped > clipped).float().detach())


def cispo(
    logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> PolicyLoss:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): REINFORCE with a clipped, detached importance weight,
    l_it = -sg[clip(r_it, 1 - eps_low, 1 + eps_high)] A_it log pi_new(y_t). Unlike the PPO clip no token's
    gradient is dropped: a clipped token still trains, with its weight capped. ``clip_low`` >= 1: no lower
    bound (the paper's setting)."""
    adv = _per_token(advantages, logp_new)
    ratio = torch.exp(logp_new - logp_old).detach()
    weight = torch.clamp(ratio, min=max(1.0 - clip_low, 0.0), max=1.0 + clip_high)
    return PolicyLoss(-weight * adv * logp_new, (weight != ratio).float())


@dataclass(frozen=True)
class PolicyLossSettings:
    """``loss.policy`` and its bounds (``reflow.config.job_config.LossSection``)."""

    name: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float = 3.0
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0
    cispo_clip_high: float = 4.0

    def __post_init__(self):
        check_choice("policy loss", self.name, POLICY_LOSSES)

    def __call__(
        self, logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> PolicyLoss:
        if self.name == "ppo_clip":
            return ppo_clip(logp_new, logp_old, advantages, self.clip_low, self.clip_high)
        if self.name == "dual_clip":
            return dual_clip(logp_new, logp_old, advantages, self.clip_low, self.clip_high, self.dual_clip_c)
        if self.name == "gspo":
            return gspo(logp_new, logp_old, advantages, mask, self.gspo_clip_low, self.gspo_clip_high)
        return cispo(logp_new, logp_old, advantages, self.cispo_clip_low, self.cispo_clip_high)
