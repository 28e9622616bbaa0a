"""Loss aggregation: how the per-token losses l_it of a minibatch become one number, with the replay loss
weights w_i (1 for a fresh sample, tau for a replayed one). Selected by ``loss.aggregation``.

Every aggregation is a ratio of two sums over the minibatch's samples, on every data-parallel rank and in
every micro-batch:

    loss = sum_i c_i sum_t m_it l_it  /  sum_i d_i

with a per-sample scale c_i (``sample_scale``) and denominator share d_i (``denominator``), both known before
the forward pass. The trainer all-reduces the denominator once per minibatch and backpropagates each
micro-batch's numerator over it, so a batch split into micro-batches and ranks gives the gradient of the
one big batch (tests/algorithms/test_aggregation.py). n_i = sum_t m_it; "sequences" below are the samples
with n_i > 0 (a sample whose every token is masked leaves the loss and its denominator).

    token_mean           c_i = w_i          d_i = w_i n_i       every token of the batch alike (DAPO eq. 8;
                                                                 with replay: (1/N) sum (w_i / Z) ..., Z the
                                                                 weighted mean of w over tokens)
    seq_mean_token_mean  c_i = w_i / n_i    d_i = w_i           each sequence's token mean, then the mean over
                                                                 sequences (the original GRPO, eq. 3)
    seq_mean_token_sum   c_i = w_i          d_i = w_i           each sequence's token sum, then the mean
    token_sum_norm       c_i = w_i          d_i = w_i L         token sums over a constant L per sequence
                                                                 (Dr. GRPO, eq. 4: L the generation budget)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reflow.algorithms.names import AGGREGATIONS, check_choice


@dataclass(frozen=True)
class Aggregation:
    name: str = "token_mean"
    norm_tokens: float = 1.0
    """L of ``token_sum_norm``: the constant each sequence's token sum is divided by."""

    def __post_init__(self):
        check_choice("loss aggregation", self.name, AGGREGATIONS)

    def sample_scale(self, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """c_i. mask (B, T), weights (B,) -> (B,)"""
        if self.name == "seq_mean_token_mean":
            return weights / mask.sum(-1).clamp(min=1.0)
        return weights

    def denominator(self, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_i d_i (float64): all-reduce it across data-parallel ranks."""
        tokens = mask.sum(-1).to(torch.float64)
        weights = weights.to(torch.float64)
        if self.name == "token_mean":
            return (tokens * weights).sum()
        sequences = (tokens > 0).to(torch.float64) * weights
        return sequences.sum() * (self.norm_tokens if self.name == "token_sum_norm" else 1.0)

    def numerator(self, values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_i c_i sum_t m_it v_it. values, mask (B, T); weights (B,)"""
        return ((values * mask).sum(-1) * self.sample_scale(mask, weights)).sum()


def replay_gradient_share(replay_fraction: float, tau: float) -> float:
    """alpha = tau*lambda / (1 - lambda + tau*lambda): the share of the gradient from replayed samples (a
    token-mean loss, replayed samples a fraction lambda of the batch at weight tau)."""
    den = 1.0 - replay_fraction + tau * replay_fraction
    return 0.0 if den <= 0 else tau * replay_fraction / den
