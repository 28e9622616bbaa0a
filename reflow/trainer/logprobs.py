"""Per-token log-probs of the targets under the policy's output head, a chunk of tokens at a time.

Torch only (no torchtitan): the device probe measures its peak on a machine that may lack the rest of the
stack (``scripts/gpu_probe.py``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from reflow.algorithms.entropy import entropy_from_logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target) under softmax(logits / T). logits (..., V), targets (...) -> (...)

    Computed as logit[target] - logsumexp(logits): one full-vocabulary fp32 copy, not three."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _head_terms(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float, entropy: str
) -> tuple[torch.Tensor, ...]:
    """One chunk: (log-probs,) or, with ``entropy`` 'logged' / 'trained', (log-probs, entropy), both of the
    same fp32 logits at the sampling temperature."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logps = token_logprobs(logits, targets, 1.0)  # (the logits are fp32 and scaled already)
    if entropy == "none":
        return (logps,)
    return logps, entropy_from_logits(logits if entropy == "trained" else logits.detach())


def chunked_token_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float, chunk_tokens: int,
    entropy: str = "none",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs(head(hidden), targets, temperature)`` without the full-vocabulary tensor: the output
    projection and the log-softmax run over ``chunk_tokens`` tokens at a time, and with gradients on each
    chunk is checkpointed (its logits are recomputed in the backward pass instead of kept), so the peak is
    one chunk's logits, ``chunk_tokens x vocab`` in the head's dtype plus its fp32 copy, whatever the
    micro-batch. hidden (B, T, D), targets (B, T) -> (B, T). ``chunk_tokens`` <= 0: one chunk.

    ``entropy`` 'logged' (detached) or 'trained' (with gradients, an entropy bonus): also each token's entropy
    under the same softmax, (B, T), from the same chunk's logits (one more chunk x vocabulary fp32 copy)."""
    batch, length = targets.shape
    flat_hidden, flat_targets = hidden.reshape(batch * length, -1), targets.reshape(batch * length)
    size = chunk_tokens if chunk_tokens > 0 else max(batch * length, 1)
    keep_graph = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    chunks = []
    for start in range(0, batch * length, size):
        args = (flat_hidden[start:start + size], flat_targets[start:start + size], head, temperature, entropy)
        chunks.append(checkpoint(_head_terms, *args, use_reentrant=False) if keep_graph else _head_terms(*args))
    if chunks:
        outputs = [torch.cat(column).reshape(batch, length) for column in zip(*chunks)]
    else:
        outputs = [flat_targets.new_zeros((batch, length), dtype=torch.float32) for _ in range(1 if entropy == "none" else 2)]
    return outputs[0] if entropy == "none" else (outputs[0], outputs[1])
