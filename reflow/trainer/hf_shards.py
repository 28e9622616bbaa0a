"""Safetensors shards written as tensors stream in: the host holds one shard at most, whatever the model's size.

Tensors arrive in one order on every participating rank (a gather on the trainer mesh, or a read from a
distributed checkpoint). Shard boundaries depend only on the tensors' names and sizes, so every rank derives
the same ones without talking; shard k is written by writer k mod W, and a rank keeps on the host only the
tensors of its own shards. At the end each writer names its shards (``model-0000k-of-0000n.safetensors``,
or ``model.safetensors`` for one) and writer 0 writes the standard ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch


class ShardWriter:
    """``add`` tensors in order, then ``close``. ``writer``/``writers``: this rank's index among the ranks that
    write, and their number (1: one process writes everything)."""

    def __init__(self, out: str, shard_bytes: int, writer: int = 0, writers: int = 1):
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
        self.out, self.shard_bytes, self.writer, self.writers = out, shard_bytes, writer, writers
        self.shards: list[list[str]] = [[]]
        """The HF names of every shard (all writers'), in order."""
        self.shard_size = 0
        self.total = 0
        self.pending: dict[str, torch.Tensor] = {}
        """The current shard's tensors, when it is this writer's."""
        os.makedirs(out, exist_ok=True)
        if writer == 0:
            for stale in [n for n in os.listdir(out) if n.startswith("model") and n.endswith((".safetensors", ".json"))]:
                os.remove(os.path.join(out, stale))  # a previous export's shards would mix with these

    def _mine(self, shard: int) -> bool:
        return shard % self.writers == self.writer

    def add(self, name: str, nbytes: int, materialize: Callable[[], torch.Tensor]) -> None:
        """The next tensor, ``nbytes`` in the file; ``materialize`` gives it on the host (called on the
        writer of its shard only: other ranks never copy it)."""
        if self.shards[-1] and self.shard_size + nbytes > self.shard_bytes:
            self._flush()
            self.shards.append([])
            self.shard_size = 0
        self.shards[-1].append(name)
        self.shard_size += nbytes
        self.total += nbytes
        if self._mine(len(self.shards) - 1):
            self.pending[name] = materialize().contiguous()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            save_file(self.pending, self._tmp(len(self.shards) - 1), metadata={"format": "pt"})
            self.pending = {}

    def _tmp(self, shard: int) -> str:
        return os.path.join(self.out, f"shard-{shard:05d}.tmp")

    def close(self) -> list[str]:
        """Write the last shard, give this writer's shards their final names, and (writer 0) the index.
        Returns every HF name written, sorted. The caller waits for every writer before reading the folder."""
        self._flush()
        count = len(self.shards)
        names = ["model.safetensors"] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        for k, name in enumerate(names):
            if self._mine(k) and self.shards[k]:
                os.replace(self._tmp(k), os.path.join(self.out, name))
        weight_map = {tensor: name for keys, name in zip(self.shards, names) for tensor in keys}
        if count > 1 and self.writer == 0:
            with open(os.path.join(self.out, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        return sorted(weight_map)
