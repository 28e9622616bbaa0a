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


def gather_full(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full tensors of FSDP2 shards, with one all-gather for all of them (``DTensor.full_tensor`` runs one
    per tensor). Every DTensor must be sharded on dim 0 along one mesh dimension (FSDP2's ``Shard(0)`` over
    dp_shard) and replicated along the others, on one mesh, in one dtype; other tensors are returned as
    they are. Every rank of the shard group calls with the same tensors in the same order.

    Shard(0) cuts dim 0 like ``torch.chunk``: rank r holds rows [r c, (r + 1) c) of d, c = ceil(d / S), the
    last ranks fewer or none. Each rank sends its rows padded to c, and the full tensor is the ranks'
    pieces in order, cut back to d rows."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sharded = [i for i, t in enumerate(tensors) if isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)]
    out = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]  # replicated DTensors: the local copy
    if not sharded:
        return out
    first = tensors[sharded[0]]
    mesh, placements = first.device_mesh, first.placements
    shard_dim = next(k for k, p in enumerate(placements) if isinstance(p, Shard))
    for i in sharded:
        t = tensors[i]
        if t.device_mesh != mesh or t.placements != placements or t.dtype != first.dtype:
            raise ValueError("gather_full: every sharded tensor must share one mesh, placements and dtype")
        if placements[shard_dim] != Shard(0) or any(not isinstance(p, (Replicate, Shard)) for p in placements):
            raise ValueError(f"gather_full: expected Shard(0) on one mesh dimension, got {placements}")
    group = mesh.get_group(shard_dim)
    size = dist.get_world_size(group)
    pieces, layout = [], []
    for i in sharded:
        t = tensors[i]
        rows = t.shape[0]
        chunk = -(-rows // size)
        local = t.to_local()
        inner = 1
        for dim in t.shape[1:]:
            inner *= dim
        padded = torch.zeros((chunk * inner,), dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local.reshape(-1)
        pieces.append(padded)
        layout.append((i, rows, chunk, inner))
    flat = torch.cat(pieces)
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat, group=group)
    offset = 0
    for i, rows, chunk, inner in layout:
        shape = tensors[i].shape
        parts = [g[offset : offset + chunk * inner].view(chunk, *shape[1:]) for g in gathered]
        out[i] = torch.cat(parts)[:rows]
        offset += chunk * inner
    return out
