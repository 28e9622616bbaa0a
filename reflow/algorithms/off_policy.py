"""Off-policy corrections against the engine's behaviour log-probs, and the mismatch they correct.
Selected by ``off_policy.correction``.

vLLM samples with log-probs ``logp_behavior``; the trainer scores the same tokens at the start of the step
(``logp_old``). The two differ because the engine ran an older policy (staleness: the decoupled modes, a
replayed sample) and because its kernels and precision are not the trainer's (engine mismatch: every mode).
With rho_it = exp(logp_old - logp_behavior), each correction gives a detached weight per token that
multiplies the policy loss:

    token_tis      min(rho_it, C)                         truncated IS per token (Espeholt et al. 2018,
                                                          IMPALA; Yao et al. 2025, "Your Efficient RL
                                                          Framework Secretly Brings You Off-Policy RL")
    sequence_tis   min(prod_t rho_it, C) on every token   truncated IS of the whole sequence (the product
                                                          is the sequence's true likelihood ratio)
    token_mask     rho_it where low <= rho_it <= high,    masked IS (MIS, Yao et al. 2025): a token outside
                   the token dropped otherwise            the band leaves the loss and its denominator
    sequence_mask  prod_t rho_it where the product is in  sequence-level MIS (Liu et al. 2025, "When Speed
                   the band, the sequence dropped         Kills Stability"): a sequence outside the band
                   otherwise                              leaves the loss
    none           1

A masking correction changes which tokens train, so its mask is applied to the loss mask before the
aggregation's denominators are counted (``drop_mask``): the trainer then scores ``logp_old`` before the
update even when a batch gets one update. Sequence products are taken in log space and capped there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reflow.algorithms.names import CORRECTIONS, check_choice

_LOG_LIMIT = 80.0  # exp(80) ~ 5.5e34: a sequence log-ratio beyond it is out of every band and over every cap


def _log_rho(logp_old: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (logp_old - logp_behavior) * mask


def sequence_log_rho(logp_old: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log prod_t rho_it over each sequence's loss tokens. (B,)"""
    return _log_rho(logp_old, logp_behavior, mask).sum(-1).clamp(-_LOG_LIMIT, _LOG_LIMIT)


@dataclass(frozen=True)
class OffPolicyCorrection:
    name: str = "token_tis"
    cap: float = 2.0
    """C of the truncated corrections."""
    band_low: float = 0.5
    """The masking corrections keep rho in [band_low, band_high]."""
    band_high: float = 2.0

    def __post_init__(self):
        check_choice("off-policy correction", self.name, CORRECTIONS)

    @property
    def masks(self) -> bool:
        """Whether the correction drops tokens (``drop_mask``), which needs ``logp_old`` before the update."""
        return self.name in ("token_mask", "sequence_mask")

    def drop_mask(self, logp_old: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) 1.0 on the tokens the correction keeps (all of them unless it masks)."""
        if self.name == "token_mask":
            rho = torch.exp(_log_rho(logp_old, logp_behavior, mask))
            return ((rho >= self.band_low) & (rho <= self.band_high)).float()
        if self.name == "sequence_mask":
            log_rho = sequence_log_rho(logp_old, logp_behavior, mask)
            inside = (log_rho >= math.log(self.band_low)) & (log_rho <= math.log(self.band_high))
            return inside.float()[:, None].expand_as(mask).contiguous()
        return torch.ones_like(mask)

    def weights(self, logp_old: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) the detached weight that multiplies each token's policy loss (on the tokens ``drop_mask``
        keeps; dropped tokens are out of the mask already)."""
        if self.name == "token_tis":
            return torch.exp(_log_rho(logp_old, logp_behavior, mask)).clamp(max=self.cap).detach()
        if self.name == "sequence_tis":
            log_rho = sequence_log_rho(logp_old, logp_behavior, mask).clamp(max=math.log(self.cap))
            return torch.exp(log_rho).detach()[:, None].expand_as(mask)
        if self.name == "token_mask":
            return torch.exp(_log_rho(logp_old, logp_behavior, mask)).detach()
        if self.name == "sequence_mask":
            return torch.exp(sequence_log_rho(logp_old, logp_behavior, mask)).detach()[:, None].expand_as(mask)
        return torch.ones_like(mask)


@dataclass
class Mismatch:
    """How far the engine's log-probs are from the trainer's on a set of tokens, summed (the trainer reduces
    the sums over ranks): mean of logp_old - logp_behavior, its largest magnitude, and the K3 estimate of
    KL(behavior || trainer), E_behavior[rho - 1 - log rho]."""

    log_ratio_sum: float
    max_abs: float
    k3_sum: float
    tokens: float


def mismatch(logp_old: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor) -> Mismatch:
    log_rho = _log_rho(logp_old, logp_behavior, mask)
    k3 = (torch.exp(log_rho) - 1.0 - log_rho) * mask
    return Mismatch(
        log_ratio_sum=log_rho.sum().item(), max_abs=log_rho.abs().max().item() if log_rho.numel() else 0.0,
        k3_sum=k3.sum().item(), tokens=mask.sum().item(),
    )
