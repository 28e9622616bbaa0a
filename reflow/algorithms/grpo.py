"""GRPO math: group-normalized advantages and the clipped, reweighted token loss.

All functions are pure tensor code so they can be checked by hand (tests/algorithms).

Per token t of sample i (mask m_it marks completion tokens):

    r_it   = exp(logp_new - logp_old)                 PPO ratio against the trainer's own
                                                      log-probs at the start of the step
    pg_it  = -min(r_it * A_i, clip(r_it, 1-eps_lo, 1+eps_hi) * A_i)
    is_it  = min(exp(logp_old - logp_behavior), C)    truncated importance weight against the
                                                      log-probs vLLM sampled with (staleness and
                                                      engine mismatch); detached, C <= 0 turns it off
    kl_it  = exp(ref - new) - (ref - new) - 1         k3 estimator of KL(new || ref)
    l_it   = is_it * pg_it + beta * kl_it

Loss weights w_i (1 for fresh samples; later issues give replayed ones tau) are
normalized over tokens across every data-parallel rank:

    loss = sum_i w_i sum_t m_it l_it / sum_j w_j n_j        (n_j = tokens of sample j)

which equals  (1/N) sum_i (w_i / Z) sum_t m_it l_it  with  Z = sum_j w_j n_j / N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) within each group g (population std). (N,) -> (N,)"""
    adv = torch.empty_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel].float()
        centred = r - r.mean()
        adv[sel] = centred / (r.std(unbiased=False) + eps) if normalize_std else centred
    return adv


@dataclass
class LossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    is_cap: float = 2.0
    kl_coef: float = 0.0


def token_loss_terms(
    logp_new: torch.Tensor,  # (B, T)
    logp_old: torch.Tensor,  # (B, T)
    logp_behavior: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B,)
    cfg: LossConfig,
    logp_ref: torch.Tensor | None = None,  # (B, T)
) -> dict[str, torch.Tensor]:
    """Per-token loss l_it and its parts, all (B, T)."""
    adv = advantages[:, None]
    ratio = torch.exp(logp_new - logp_old)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    if cfg.is_cap > 0:
        is_w = torch.exp(logp_old - logp_behavior).clamp(max=cfg.is_cap).detach()
    else:
        is_w = torch.ones_like(pg)
    loss = is_w * pg
    out = {"ratio": ratio.detach(), "is_weight": is_w, "pg": pg.detach()}
    out["clipped"] = ((ratio * adv) > (clipped * adv)).float().detach()
    if cfg.kl_coef > 0:
        assert logp_ref is not None, "kl_coef > 0 needs reference log-probs"
        d = logp_ref - logp_new
        kl = torch.exp(d) - d - 1.0
        loss = loss + cfg.kl_coef * kl
        out["kl"] = kl.detach()
    out["loss"] = loss
    return out


def weighted_token_sum(values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i sum_t m_it v_it. values, mask: (B, T); weights: (B,)"""
    return (values * mask * weights[:, None]).sum()


def loss_denominator(mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """This rank's share of sum_j w_j n_j; all-reduce it across data-parallel ranks."""
    return (mask.sum(-1) * weights).sum()


def replay_gradient_share(replay_fraction: float, tau: float) -> float:
    """alpha = tau*lambda / (1 - lambda + tau*lambda): the share of the gradient from replayed samples."""
    den = 1.0 - replay_fraction + tau * replay_fraction
    return 0.0 if den <= 0 else tau * replay_fraction / den
