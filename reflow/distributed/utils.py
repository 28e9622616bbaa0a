"""Process groups and device meshes.

Every rank runs the same program, so every constructor here is called by every
rank at the same point (a ``DeviceMesh`` or ``new_group`` over a subset of
ranks still needs all ranks to call it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from reflow.distributed.host_memory import exact_pinned_allocations

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
        timeout = timedelta(seconds=timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None:
            # under torchrun: the agent's store outlives a restart (--max-restarts), and the restarted ranks
            # would read the dead ranks' addresses from it (gloo: "connectFullMesh failed ... Connection
            # refused"). Every attempt gets keys of its own.
            hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                is_master=not hosted_by_agent and os.environ["RANK"] == "0", timeout=timeout,
            )
            dist.init_process_group(
                backend=backend, store=dist.PrefixStore(f"reflow/attempt-{attempt}", store), timeout=timeout,
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
            )
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type() == "cuda":
        # pin_local_gpu leaves each rank exactly its own GPU visible: then it is device 0, whatever LOCAL_RANK is
        local = int(os.environ.get("LOCAL_RANK", 0))
        index = 0 if torch.cuda.device_count() == 1 else local
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        exact_pinned_allocations()
    else:
        device = torch.device("cpu")
    return rank, world, device


@dataclass
class TrainerLayout:
    """One trainer placement: the HSDP mesh (dp_replicate = replicas, dp_shard = shard_degree) over ranks
    0 .. replicas * shard_degree - 1, and a process group over those ranks. Every rank holds the objects;
    a non-member's mesh coordinate is None."""

    replicas: int
    shard_degree: int
    mesh: DeviceMesh
    group: object

    @property
    def num_ranks(self) -> int:
        return self.replicas * self.shard_degree

    @property
    def name(self) -> str:
        return f"T{self.replicas}x{self.shard_degree}"

    def has(self, rank: int) -> bool:
        return rank < self.num_ranks


def build_trainer_layouts(world_size: int, shard_degree: int, replica_counts: list[int]) -> dict[int, TrainerLayout]:
    """Meshes and groups of every listed replica count, built now: ``DeviceMesh`` and ``new_group`` are
    collective over the world, so a placement change at runtime may only use what exists from startup.
    Every rank calls this with the same arguments."""
    layouts = {}
    for replicas in sorted(set(replica_counts), reverse=True):
        ranks = list(range(replicas * shard_degree))
        if len(ranks) > world_size:
            raise ValueError(f"{replicas} x {shard_degree} trainer ranks exceed the world size {world_size}")
        mesh = DeviceMesh(
            device_type(), torch.tensor(ranks, dtype=torch.int).view(replicas, shard_degree),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
        group = dist.group.WORLD if len(ranks) == world_size else dist.new_group(ranks)
        layouts[replicas] = TrainerLayout(replicas, shard_degree, mesh, group)
    return layouts


def exit_ranks(code: int = 0) -> None:
    """End a script that drives reflow's components under torchrun: every rank waits for the others, the process
    groups are destroyed, and the process exits without the interpreter's finalization.

    Finalization is where gloo's worker threads, kept alive by the device meshes that still reference their groups,
    now and then abort the rank (SIGABRT, "terminate called without an active exception") after its work is done
    and written. ``reflow.train`` returns normally instead: vLLM's exit hook needs the default group then."""
    import sys

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
