"""Parking trainer state in host memory while the colocated engine uses the device, and bringing it back.

A colocated rank (``sync`` mode) alternates: the engine generates, then the trainer trains. On a GPU the two
cannot both hold their state for a 4B-32B model, so while the engine is awake the trainer's parameter
shards, AdamW moments and the frozen reference live in pinned host memory, and the engine sleeps (vLLM's
``sleep``) while the trainer trains.

How: every *storage* behind the given tensors (an FSDP2 sharded parameter is a view into a padded flat
storage; a storage shared by several tensors is moved once) is copied whole into a host buffer, then its
device allocation is freed with ``untyped_storage().resize_(0)``: the tensors, views and DTensor wrappers
stay the same Python objects, so FSDP2, the optimizer and every reference to them remain valid. Bringing
it back re-allocates each storage and copies the bytes in, bitwise. ``torch.cuda.empty_cache()`` hands the
freed blocks to the device, for vLLM to take.

Order on one rank (``PolicyTrainer.park`` / ``unpark``): the optimizer state and the reference first (the
weight sync does not need them), then the parameters after the weight sync has read them; all of it
back before the next train step.
"""

from __future__ import annotations

import torch


class HostParking:
    """Storages moved to host memory, by group name ("optimizer", "parameters"); ``pin`` for fast copies
    (pinned memory needs CUDA).

    The host buffers are kept between parkings: a group parks every step (sync mode), and pinning is slow
    (page-locking gigabytes takes seconds) and, through PyTorch's host cache, would otherwise leave the freed
    buffers cached anyway. So each group owns one host buffer per storage, at the storage's exact size
    (``reflow.distributed.host_memory.exact_pinned_allocations``), allocated at its first parking and reused: what
    a rank pins is exactly what the memory plan's pinned term counts, all run long."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.parked: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}
        self.buffers: dict[str, list[torch.Tensor]] = {}
        """Each group's host buffers, parked or not."""

    def __contains__(self, name: str) -> bool:
        return name in self.parked

    @property
    def host_bytes(self) -> int:
        """Host memory the buffers hold (pinned when ``pin``)."""
        return sum(buffer.numel() for buffers in self.buffers.values() for buffer in buffers)

    def _buffers(self, name: str, sizes: list[int]) -> list[torch.Tensor]:
        """The group's buffers for storages of these sizes: the kept ones if the sizes match (the same
        trainer state, parked again), else new ones (a placement change resized the shards)."""
        kept = self.buffers.get(name)
        if kept is None or [buffer.numel() for buffer in kept] != sizes:
            self.buffers.pop(name, None)  # dropped before the new ones are allocated
            kept = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for size in sizes]
            self.buffers[name] = kept
        return kept

    def release(self) -> None:
        """Drop every buffer of groups not parked now (the trainer left this rank: nothing parks again)."""
        for name in [name for name in self.buffers if name not in self.parked]:
            del self.buffers[name]

    @torch.no_grad()
    def park(self, name: str, tensors: list[torch.Tensor]) -> int:
        """Copy the storages behind ``tensors`` to host memory and free them on their device. Returns the bytes."""
        if name in self.parked:
            raise RuntimeError(f"trainer state {name!r} is already parked")
        storages, seen = [], set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            storages.append(storage)
        copies = list(zip(storages, self._buffers(name, [storage.nbytes() for storage in storages])))
        for storage, host in copies:
            host.copy_(_as_bytes(storage), non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the host copies are complete before the device bytes go
        for storage, _ in copies:
            storage.resize_(0)
        self.parked[name] = copies
        return sum(host.numel() for _, host in copies)

    @torch.no_grad()
    def unpark(self, name: str) -> int:
        """Re-allocate the parked storages on their device and copy the bytes back (the host buffers stay, for
        the next parking). Returns the bytes."""
        copies = self.parked.pop(name, None)
        if copies is None:
            return 0
        for storage, host in copies:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the device copies are complete before the buffers are written again
        return sum(host.numel() for _, host in copies)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
