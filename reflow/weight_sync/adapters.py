"""Trainer -> rollout sync of a LoRA run: the adapters only, as a new adapter version in each engine.

Every rank derives the same ``AdapterPlan`` from the model config and the [lora] section on the meta device
(each adapter's torchtitan keys, peft names and shapes), so a rollout-only rank knows the layout without a
metadata exchange, as in ``reflow.weight_sync.broadcast``:

    trainer ranks        one all-gather of every adapter's shards, cast to the engine's dtype first (the dtype
                         vLLM computes the adapters in), in the replicas that feed an engine
                         (``gathers_full_weights``)
    trainer rank 0       flattens them into one tensor, broadcasts it over the sync group
    rollout-only ranks   receive it and split it
    every engine rank    writes version v's peft folder on local disk and loads it (``load_adapter``): new
                         requests take v, requests in flight finish on their own version, the base weights
                         and the KV cache stay as they are

A sync moves 2 r (in + out) numbers per adapted projection instead of the whole model (the benchmark:
``python -m reflow.bench lora``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from reflow.distributed.buckets import gather_full
from reflow.distributed.placement import Placement
from reflow.trainer.lora import PEFT_CONFIG, PEFT_WEIGHTS, AdapterPlan
from reflow.weight_sync.broadcast import gathers_full_weights


class AdapterSync:
    """Moves the trainer's adapters into every rollout rank's engine as a new version. All ranks call ``sync``
    together (the ``WeightSync`` interface)."""

    def __init__(self, placement: Placement, plan: AdapterPlan, rank: int, device: torch.device):
        self.placement, self.plan, self.rank, self.device = placement, plan, rank, device
        self.src = placement.trainer_ranks[0]
        receivers = [r for r in placement.rollout_ranks if not placement.is_trainer(r)]
        self.group = dist.new_group([self.src] + receivers) if receivers else None  # (collective: every rank)
        self.gathers = gathers_full_weights(placement, rank)
        self.folder = tempfile.mkdtemp(prefix=f"reflow-adapters-rank{rank}-")
        """This rank's adapter versions, each a peft folder (``v<version>``)."""

    def _tensors(self, trainer) -> torch.Tensor | None:
        """The adapters as one flat tensor in the plan's dtype, on the ranks that have them after the collectives."""
        if self.gathers:
            state = trainer.model.state_dict()
            fulls = gather_full([state[key].detach().to(self.plan.dtype) for key, _, _ in self.plan.tensors])
            flat = torch.cat([t.reshape(-1) for t in fulls]).to(self.device)
            if self.group is not None and self.rank == self.src:
                dist.broadcast(flat, src=self.src, group=self.group)
            return flat
        if self.placement.is_trainer(self.rank):
            return None  # a trainer replica that feeds no engine: no collective of this sync involves it
        flat = torch.empty(self.plan.numel, dtype=self.plan.dtype, device=self.device)
        dist.broadcast(flat, src=self.src, group=self.group)
        return flat

    def _write(self, flat: torch.Tensor, version: int) -> str:
        from safetensors.torch import save_file

        tensors, offset = {}, 0
        for _, name, shape in self.plan.tensors:
            n = torch.Size(shape).numel()
            tensors[name] = flat[offset: offset + n].view(shape).to("cpu").contiguous()
            offset += n
        folder = os.path.join(self.folder, f"v{version}")
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, PEFT_WEIGHTS))
        with open(os.path.join(folder, PEFT_CONFIG), "w") as f:
            json.dump(self.plan.config, f)
        return folder

    def _forget(self, engine) -> None:
        """Remove the folders of the versions the engine dropped (vLLM reads a version's folder again whenever
        it brings that adapter back into a batch: a folder stays while its version is loaded)."""
        for name in os.listdir(self.folder):
            if int(name[1:]) not in engine.loaded:
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def sync(self, trainer, engine, version: int) -> dict[str, float]:
        """trainer: this rank's PolicyTrainer or None; engine: this rank's RolloutEngine."""
        t0 = time.time()
        flat = self._tensors(trainer)
        if self.placement.is_rollout(self.rank) and flat is not None:
            engine.load_adapter(self._write(flat, version), version)
            self._forget(engine)
        return {"weight_sync_s": time.time() - t0, "weight_sync_numel": float(self.plan.numel)}

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
