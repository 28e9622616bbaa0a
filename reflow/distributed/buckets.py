"""Bucketized broadcast: many tensors moved in a few large collectives.

Every gloo (or NCCL) broadcast has a fixed cost (about a millisecond on gloo here), so moving a model's
hundreds of shard tensors one by one is dominated by it. The tensors are grouped, in order, into flat
buckets of about ``bucket_bytes`` of one (device, dtype) each, and each bucket is one broadcast.
Both sides derive the same list of tensors (names, shapes, dtypes) on their own, so no metadata moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def plan_buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets of about ``bucket_bytes``, one (device, dtype) each, in order.

    Keyed on the device too: AdamW's ``step`` lives on the CPU even when the shards are on a GPU, so on
    CUDA the step counters form their own small bucket (over the gloo half of "cpu:gloo,cuda:nccl")."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    buckets: list[list[int]] = []
    for i, tensor in enumerate(tensors):
        key = (tensor.device, tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        current, size = open_buckets.get(key, ([], 0))
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        open_buckets[key] = (current, size + nbytes)
    buckets.extend(current for current, _ in open_buckets.values() if current)
    return buckets


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], src: int, group, bucket_bytes: int | None) -> int:
    """Broadcast ``tensors`` in place from global rank ``src`` to the other members of ``group``.

    ``bucket_bytes`` None: one broadcast per tensor (the baseline the benchmark compares with). Returns the
    number of collectives."""
    if bucket_bytes is None:
        for tensor in tensors:
            dist.broadcast(tensor, src=src, group=group)
        return len(tensors)
    is_src = dist.get_rank() == src
    buckets = plan_buckets(tensors, bucket_bytes)
    for bucket in buckets:
        members = [tensors[i] for i in bucket]
        if is_src:
            flat = torch.cat([t.reshape(-1) for t in members])
        else:
            flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype, device=members[0].device)
        dist.broadcast(flat, src=src, group=group)
        if not is_src:
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
    return len(buckets)
