"""The trainer group's collectives of a decoupled run, typed: the readiness exchange and reducing named stats.

Both run on the main thread of every trainer rank at the same point (``reflow.modes.decoupled``), over the
trainer mesh's gloo group; the data and control planes' threads never use that group.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from reflow.types import ShardReadiness, TrainerView


class GlooReadinessExchange:
    """A ``ReadinessExchange`` over a trainer group: one all-reduce(SUM) of [not-ready flags, retired per
    rollout worker, filtered per rollout worker, then each shard's eligible, need, urgent and unused counts in
    its own slot]."""

    def __init__(self, group, shard_index: int, num_shards: int, num_rollout: int):
        self.group, self.shard_index, self.num_shards, self.num_rollout = group, shard_index, num_shards, num_rollout

    def exchange(self, reports: Sequence[ShardReadiness]) -> TrainerView:
        (mine,) = reports  # a rank holds one shard
        num_rollout, num_shards = self.num_rollout, self.num_shards
        counts = torch.zeros(1 + 2 * num_rollout + 4 * num_shards, dtype=torch.long)
        counts[0] = int(not mine.ready)
        counts[1 : 1 + num_rollout] = torch.tensor(mine.retired, dtype=torch.long)
        counts[1 + num_rollout : 1 + 2 * num_rollout] = torch.tensor(mine.filtered, dtype=torch.long)
        base = 1 + 2 * num_rollout
        for k, value in enumerate((mine.eligible, mine.need, mine.urgent, mine.unused)):
            counts[base + k * num_shards + self.shard_index] = value
        dist.all_reduce(counts, group=self.group)
        per_shard = [tuple(counts[base + k * num_shards : base + (k + 1) * num_shards].tolist()) for k in range(4)]
        return TrainerView(
            all_ready=counts[0].item() == 0, retired=tuple(counts[1 : 1 + num_rollout].tolist()),
            filtered=tuple(counts[1 + num_rollout : base].tolist()),
            eligible=per_shard[0], need=per_shard[1], urgent=per_shard[2], unused=per_shard[3],
        )


def reduce_stats(stats: Mapping[str, float | list[float]], group, op: str = "sum") -> dict[str, float | list[float]]:
    """Every trainer rank's ``stats`` (the same keys, and lists of the same length, on every rank) reduced by
    ``op`` ("sum" or "max") over ``group``, by name."""
    keys = sorted(stats)
    lengths = {key: len(stats[key]) if isinstance(stats[key], list) else None for key in keys}
    flat: list[float] = []
    for key in keys:
        value = stats[key]
        flat.extend(value if isinstance(value, list) else [value])
    tensor = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    values = tensor.tolist()
    out: dict[str, float | list[float]] = {}
    position = 0
    for key in keys:
        if lengths[key] is None:
            out[key] = values[position]
            position += 1
        else:
            out[key] = values[position : position + lengths[key]]
            position += lengths[key]
    return out
