"""Trainer -> rollout weight sync: gather on the trainer mesh, bucketed flat broadcast, reload into vLLM.

Every rank derives the same ``SyncPlan`` from the model config on the meta
device (no trainer state needed), so rollout-only ranks know every bucket's
layout (HF names, shapes, dtype) without any metadata exchange:

    trainer ranks        for each bucket: one all-gather of its parameters' shards (``gather_full``), cast to
                         the engine's dtype first (half the bytes of a float32 gather, and no float32 copy
                         of the bucket), and only in the replicas that feed an engine: replica 0 (the
                         broadcast's source) and, colocated, every replica (each rank's own engine); the
                         other replicas of a decoupled placement hold shards no engine needs and skip it
    trainer rank 0       flattens the bucket into one tensor, broadcasts it over the sync group
    rollout-only ranks   receive the flat bucket, split it, hand (hf_name, tensor) to vLLM
    colocated ranks      (train and generate) feed their own gathered tensors to vLLM

vLLM consumes one iterator per sync (``reload_weights``), so the buckets are
produced lazily inside it: one bucket of memory in flight, not the whole model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reflow.distributed.buckets import gather_full
from reflow.distributed.placement import Placement
from reflow.model.qwen3 import build_on_meta
from reflow.trainer.lora import adapters_of, merge


@dataclass
class SyncPlan:
    buckets: list[list[tuple[str, str, tuple[int, ...]]]]
    """Per bucket: (torchtitan name, HF name, shape) of each tensor, in order."""
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(_numel(s) for b in self.buckets for _, _, s in b)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_sync_plan(model_config, adapter, bucket_size_mb: float, dtype: torch.dtype) -> SyncPlan:
    """Group the model's tensors (state-dict order) into buckets of about bucket_size_mb."""
    meta = build_on_meta(model_config)
    limit = max(1, int(bucket_size_mb * 2**20 / torch.empty(0, dtype=dtype).element_size()))
    buckets, cur, size = [], [], 0
    for name, value in meta.state_dict().items():
        hf = adapter.to_hf({name: value})
        for hf_name, hf_value in hf.items():
            cur.append((name, hf_name, tuple(hf_value.shape)))
            size += hf_value.numel()
        if size >= limit:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return SyncPlan(buckets=buckets, dtype=dtype)


def gathers_full_weights(placement: Placement, rank: int) -> bool:
    """Does ``rank`` gather the full weights at a sync? The trainer replicas that feed an engine do: replica 0,
    whose first rank broadcasts to the rollout-only ranks, and every replica of a colocated placement (each
    rank feeds its own engine). A replica gathers as a whole (one all-gather over its shard group)."""
    if not placement.is_trainer(rank):
        return False
    return placement.colocated or rank // placement.shard_degree == 0


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A shard (DTensor or plain) in ``dtype``: DTensor's ``to`` casts the local shard and keeps the placement."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


class WeightSync:
    """Moves the trainer's weights into every rollout rank's vLLM engine. All ranks call ``sync`` together."""

    def __init__(self, placement: Placement, plan: SyncPlan, rank: int, device: torch.device):
        self.placement = placement
        self.plan = plan
        self.rank = rank
        self.device = device
        self.src = placement.trainer_ranks[0]
        receivers = [r for r in placement.rollout_ranks if not placement.is_trainer(r)]
        # created by every rank (new_group is collective); None when everyone is colocated
        self.group = dist.new_group([self.src] + receivers) if receivers else None
        self.gathers = gathers_full_weights(placement, rank)

    def _bucket_tensors(self, trainer, state: dict, bucket) -> list[tuple[str, torch.Tensor]]:
        """The bucket's full tensors under their HF names, in the engine's dtype: one all-gather on the
        trainer mesh for the bucket, of shards cast before it (a cast is per element: the same values as
        casting the gathered tensor, bitwise). A LoRA run's adapted projections are gathered apart, in float32
        with their adapters, and merged (W + (alpha / r) B A) before the cast: the engine serves the adapted
        model (``reflow.trainer.lora``)."""
        names = [tt_name for tt_name, _, _ in bucket]
        adapted = adapters_of(state, names)
        plain = [name for name in names if name not in adapted]
        fulls = dict(zip(plain, gather_full([_cast(state[name].detach(), self.plan.dtype) for name in plain])))
        if adapted:
            keys = [key for name, pair in adapted.items() for key in (name, *pair)]
            gathered = dict(zip(keys, gather_full([_cast(state[key].detach(), torch.float32) for key in keys])))
            for name, (a, b) in adapted.items():
                fulls[name] = merge(gathered[name], gathered[a], gathered[b], trainer.lora_scale).to(self.plan.dtype)
        out = []
        for tt_name, hf_name, shape in bucket:
            full = fulls[tt_name]
            hf = trainer.adapter.to_hf({tt_name: full})
            out.append((hf_name, hf[hf_name].reshape(shape)))
        return out

    def _stream(self, trainer):
        """Yield (hf_name, tensor) for this rank's engine, running the collectives bucket by bucket."""
        if not self.gathers:  # a trainer replica that feeds no engine, or a rollout-only rank
            if self.placement.is_trainer(self.rank):
                return  # no collective of this sync involves it
            yield from self._receive_all()
            return
        trainer.unpark("parameters")
        state = trainer.model.state_dict()
        for bucket in self.plan.buckets:
            tensors = self._bucket_tensors(trainer, state, bucket)
            if self.group is not None and self.rank == self.src:
                flat = torch.cat([t.reshape(-1) for _, t in tensors]).to(self.device)
                dist.broadcast(flat, src=self.src, group=self.group)
            yield from tensors

    def _receive_all(self):
        """A rollout-only rank: each bucket from the source's broadcast, split into its tensors."""
        for bucket in self.plan.buckets:
            flat = torch.empty(sum(_numel(s) for _, _, s in bucket), dtype=self.plan.dtype, device=self.device)
            dist.broadcast(flat, src=self.src, group=self.group)
            off = 0
            for _, hf_name, shape in bucket:
                n = _numel(shape)
                yield hf_name, flat[off : off + n].view(shape)
                off += n

    def sync(self, trainer, engine, version: int) -> dict[str, float]:
        """trainer: this rank's PolicyTrainer or None; engine: this rank's RolloutEngine.

        Rollout ranks reload their engine; trainer-only ranks just take part in the collectives."""
        t0 = time.time()
        stream = self._stream(trainer)
        if self.placement.is_rollout(self.rank):
            engine.load_weights(stream, version)
        else:
            for _ in stream:
                pass
        dt = time.time() - t0
        return {"weight_sync_s": dt, "weight_sync_numel": float(self.plan.numel)}
