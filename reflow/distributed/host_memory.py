"""Pinned host memory, process-wide: what the pinned allocator rounds, and handing its cache back to the OS.

The trainer's parked state (``reflow.trainer.offload``) and vLLM's level-1 weight backups are pinned through
PyTorch's caching host allocator; ``reflow.memory_plan`` counts them at their exact sizes, which these two
settings make true.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("reflow")

PINNED_ROUND_THRESHOLD_MB = 16
"""Pinned host allocations above this size are made at their size, not rounded up to a power of two."""


def exact_pinned_allocations() -> bool:
    """PyTorch's pinned host allocator rounds every allocation up to a power of two (for reuse of small
    staging buffers): the trainer's parked shards and vLLM's level-1 weight backups, a few large
    allocations each, would pin 1.0-2.0x their size (1.37x for an 8B trainer's shards). Above
    ``PINNED_ROUND_THRESHOLD_MB`` they are made at their size, which the memory plan then counts exactly;
    the small ones keep the rounding. Process-wide, before the first pinned allocation. Returns whether this
    torch has the setting (an older one rounds everything: the device probe reports the factor)."""
    setting = f"pinned_max_round_threshold_mb:{PINNED_ROUND_THRESHOLD_MB}"
    apply = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if apply is None:
        logger.warning("this torch (%s) cannot size pinned allocations exactly: the memory plan's pinned figures "
                       "are low by up to 2x", torch.__version__)
        return False
    try:
        apply(setting)
    except RuntimeError as error:  # a torch whose parser does not know the key
        logger.warning("pinned allocations stay rounded to powers of two (%s): %s", setting, error)
        return False
    return True


def release_host_cache() -> None:
    """Hand PyTorch's cached, unused pinned host blocks back to the OS."""
    if not torch.cuda.is_available():
        return  # no pinned memory without CUDA (and the accelerator API raises)
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        empty()
    else:  # torch before the accelerator API had it
        torch._C._host_emptyCache()
