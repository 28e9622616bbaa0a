"""Process groups and device meshes.

Every rank runs the same program, so every constructor here is called by every
rank at the same point (a ``DeviceMesh`` or ``new_group`` over a subset of
ranks still needs all ranks to call it).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from reflow.distributed.placement import Placement

logger = logging.getLogger("reflow")


def device_type() -> str:
    """'cuda' when an accelerator exists, else 'cpu' (torchtitan's own helper falls back to 'cuda')."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: int = 1800) -> tuple[int, int, torch.device]:
    """Initialize the default process group (gloo on CPU; NCCL for CUDA tensors plus gloo for CPU ones)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            # plain `python -m reflow.train`: a one-rank world
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        backend = "cpu:gloo,cuda:nccl" if device_type() == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type() == "cuda":
        # pin_local_gpu leaves each rank exactly its own GPU visible: then it is device 0, whatever LOCAL_RANK is
        local = int(os.environ.get("LOCAL_RANK", 0))
        index = 0 if torch.cuda.device_count() == 1 else local
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    return rank, world, device


def build_trainer_mesh(placement: Placement) -> DeviceMesh:
    """The HSDP mesh (dp_replicate, dp_shard) over the trainer ranks; non-members get coordinate None."""
    ranks = torch.tensor(placement.trainer_ranks, dtype=torch.int).view(placement.replicate_degree, placement.shard_degree)
    return DeviceMesh(device_type(), ranks, mesh_dim_names=("dp_replicate", "dp_shard"))


def build_trainer_group(placement: Placement):
    """One process group over all trainer ranks, for global sums across data-parallel ranks."""
    if placement.num_trainer_ranks == placement.world_size:
        return dist.group.WORLD
    return dist.new_group(placement.trainer_ranks)
