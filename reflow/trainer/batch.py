"""The trainer's input: packed token rows with per-token behavior data.

Everything per token is aligned to *targets*: column t describes the token at
position t+1, predicted from positions <= t.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from reflow.types import Sample


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # (B, T) long, right-padded prompt + completion
    loss_mask: torch.Tensor  # (B, T-1) float, 1 on targets the model generated (never prompt or environment tokens)
    behavior_logprobs: torch.Tensor  # (B, T-1) float, vLLM's log-probs of the sampled tokens (0 off the mask)
    versions: torch.Tensor  # (B, T-1) long, policy version that produced each model token (-1 elsewhere)
    advantages: torch.Tensor  # (B,) float
    weights: torch.Tensor  # (B,) float, loss weight omega_i (tau * omega_i for replayed samples)
    rewards: torch.Tensor  # (B,) float

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, end: int) -> "TrainBatch":
        return TrainBatch(**{f.name: getattr(self, f.name)[start:end] for f in fields(self)})

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def loss_weighted_tokens(self) -> float:
        """Tokens that carry loss weight, each row's counted at its weight (a replayed row at tau): what the step
        learns from, which neither replayed rows at a small tau nor masked tokens can inflate."""
        return float((self.loss_mask.sum(-1) * self.weights).sum().item())


def pack(
    prompts: list[list[int]],
    completions: list[list[int]],
    behavior_logprobs: list[list[float]],
    versions: list[list[int]],
    advantages: list[float],
    weights: list[float],
    rewards: list[float],
    pad_id: int,
    model_spans: list[list[list[int]]] | None = None,
) -> TrainBatch:
    """Right-pad prompt+completion rows into a TrainBatch.

    ``model_spans[i]`` lists the [start, end) ranges of completion i the model generated (a multi-turn
    trajectory: the environment's tokens between them are context, never targets); row i's log-probs and
    versions are those tokens' in order. None: every completion token is the model's."""
    assert len(prompts) == len(completions) == len(behavior_logprobs) == len(advantages)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    B = len(prompts)
    tokens = torch.full((B, width), pad_id, dtype=torch.long)
    mask = torch.zeros(B, width - 1)
    blp = torch.zeros(B, width - 1)
    ver = torch.full((B, width - 1), -1, dtype=torch.long)
    for i, (p, c, lp, v) in enumerate(zip(prompts, completions, behavior_logprobs, versions)):
        spans = model_spans[i] if model_spans is not None else [[0, len(c)]]
        # the target columns of the model's tokens: completion token j is predicted at column len(p) - 1 + j
        columns = (
            torch.cat([torch.arange(start, end) for start, end in spans]) + len(p) - 1 if spans
            else torch.zeros(0, dtype=torch.long)
        )
        assert len(columns) == len(lp) == len(v), "one behavior log-prob and version per model token"
        assert all(0 <= start <= end <= len(c) for start, end in spans), "model spans inside the completion"
        row = p + c
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, columns] = 1.0
        blp[i, columns] = torch.tensor(lp, dtype=torch.float32)
        ver[i, columns] = torch.tensor(v, dtype=torch.long)
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logprobs=blp,
        versions=ver,
        advantages=torch.tensor(advantages, dtype=torch.float32),
        weights=torch.tensor(weights, dtype=torch.float32),
        rewards=torch.tensor(rewards, dtype=torch.float32),
    )


def plan_micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """The rows of each forward/backward pass, from each row's token count: rows grouped by length, so a pass
    pads its rows only to its own longest one.

    ``max_tokens`` 0: ``max_rows`` rows a pass, shortest first. Otherwise the longest row left opens a pass and the
    next longest join it while there are at most ``max_rows`` of them and rows x its length stays within
    ``max_tokens`` (a row longer than that runs alone): a long-tail straggler pads a handful of rows instead of
    ``max_rows``. Stable: rows of equal length keep their order."""
    if max_rows < 1 or max_tokens < 0:
        raise ValueError(f"max_rows must be >= 1 and max_tokens >= 0, got {max_rows} and {max_tokens}")
    ascending = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if max_tokens == 0:
        return [ascending[i : i + max_rows] for i in range(0, len(ascending), max_rows)]
    passes, left = [], ascending[::-1]
    while left:
        width = max(lengths[left[0]], 1)
        take = max(1, min(max_rows, max_tokens // width, len(left)))
        passes.append(sorted(left[:take], key=lambda i: (lengths[i], i)))
        left = left[take:]
    return passes


def zero_batch(template: TrainBatch | None) -> TrainBatch:
    """A one-row batch that contributes nothing (zero weight and mask) but runs the FSDP collectives."""
    tokens = template.tokens[:1].clone() if template is not None and template.size else torch.zeros(1, 2, dtype=torch.long)
    w = tokens.shape[1] - 1
    return TrainBatch(
        tokens=tokens,
        loss_mask=torch.zeros(1, w),
        behavior_logprobs=torch.zeros(1, w),
        versions=torch.full((1, w), -1, dtype=torch.long),
        advantages=torch.zeros(1),
        weights=torch.zeros(1),
        rewards=torch.zeros(1),
    )


def index(batch: TrainBatch, idx: torch.Tensor) -> TrainBatch:
    return TrainBatch(**{f.name: getattr(batch, f.name)[idx] for f in fields(batch)})


def mask_stale_tokens(batch: TrainBatch, oldest_version: int) -> int:
    """Take model tokens produced before ``oldest_version`` out of the loss (replay.max_head_lag): the head of a
    long trajectory that a much older policy wrote. The rest of the row still trains, and the loss
    normalization counts only the tokens left. Returns how many tokens were masked."""
    stale = (batch.versions >= 0) & (batch.versions < oldest_version) & (batch.loss_mask > 0)
    batch.loss_mask[stale] = 0.0
    return int(stale.sum().item())


def to_batch(
    samples: list["Sample"], pad_id: int, weights: list[float] | None = None, mask_truncated: bool = False
) -> TrainBatch:
    """Samples packed for a train step (loss weights default to 1; a single-turn sample's whole response is
    the model's). ``mask_truncated``: DAPO's overlong filtering (loss.mask_truncated), a sample cut at the
    length cap keeps no loss token, so it leaves the loss and its normalization."""
    weights = weights if weights is not None else [1.0] * len(samples)
    batch = pack(
        [s.prompt_ids for s in samples],
        [s.output_ids for s in samples],
        [s.logprobs for s in samples],
        [s.versions for s in samples],
        [s.advantage for s in samples],
        weights,
        [s.reward for s in samples],
        pad_id,
        [s.model_spans if s.model_spans is not None else [[0, len(s.output_ids)]] for s in samples],
    )
    if mask_truncated:
        for row, sample in enumerate(samples):
            if sample.finish_reason == "length":
                batch.loss_mask[row] = 0.0
    return batch
