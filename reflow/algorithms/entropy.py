"""The policy's entropy per token, from the logits of a chunk of tokens (``reflow.trainer.policy``'s chunked
head): H_t = logsumexp(z) - sum_v softmax(z)_v z_v, in fp32 at the sampling temperature. Logged every step;
``loss.entropy_coef`` > 0 subtracts coef * H_t from each token's loss (an entropy bonus, with gradients)."""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) fp32 logits -> (...) entropy in nats."""
    log_z = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_z - (probs * logits).sum(-1)
