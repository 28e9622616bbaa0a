"""2 ranks, one trainer replica of 2 shards, KL penalty on: train 3 steps straight, then 3 steps with the
trainer's state parked in host memory between steps (the path ``sync`` mode takes on CUDA, here with
unpinned memory), and compare. Writes a JSON report to argv[1]."""

import json
import sys

import torch
import torch.distributed as dist

from reflow.config.job_config import JobConfig
from reflow.distributed import build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.recipe import load_recipe, resolve_path
from reflow.trainer.batch import pack
from reflow.trainer.elastic import shard_tensors
from reflow.trainer.offload import HostParking
from reflow.trainer.policy import PolicyTrainer

rank, world, device = init_distributed()
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
layouts = build_trainer_layouts(world, world, [1])
cfg = JobConfig()
cfg.training.lr = 2e-3
cfg.kl.coef = 0.05
cfg.training.micro_batch_size = 2


def batch(step: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    rows = []
    for _ in range(4):
        n = int(torch.randint(3, 13, (1,), generator=gen))
        rows.append((torch.randint(3, 30, (4,), generator=gen).tolist(), torch.randint(3, 30, (n,), generator=gen).tolist(), n))
    return pack(
        [p for p, _, _ in rows], [o for _, o, _ in rows], [(-torch.rand(n, generator=gen)).tolist() for _, _, n in rows],
        [[0] * n for _, _, n in rows], [float(torch.randn(1, generator=gen)) for _ in rows], [1.0] * 4, [0.0] * 4, 0,
    )


def train(parked: bool):
    trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
    freed, restored, buffers = [], [], []
    if parked:
        trainer.parking = HostParking(pin=False)
    for step in range(3):
        if parked:
            moved = trainer.park("optimizer")
            moved += trainer.park("optimizer", "parameters")  # the optimizer is parked already: not twice
            tensors = shard_tensors(trainer.model, trainer.optimizer, trainer.ref_model)
            # every shard's device bytes are gone (the step counters live on the host anyway)
            freed.append([moved, all(t.untyped_storage().nbytes() == 0 for t in tensors if t.dim() > 0)])
            # the host buffers: one per storage at its size, the same ones every step
            buffers.append([trainer.parking.host_bytes,
                            sorted(b.data_ptr() for bs in trainer.parking.buffers.values() for b in bs)])
        trainer.train_step(batch(step))
        if parked:
            restored.append(all(t.untyped_storage().nbytes() > 0
                                for t in shard_tensors(trainer.model, trainer.optimizer, trainer.ref_model)))
    return [t.clone() for t in shard_tensors(trainer.model, trainer.optimizer, trainer.ref_model)], freed, restored, buffers


straight, _, _, _ = train(parked=False)
parked, freed, restored, buffers = train(parked=True)
flags = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(straight, parked)))])
dist.all_reduce(flags, op=dist.ReduceOp.MIN)
expected = sum(t.numel() * t.element_size() for t in straight if t.dim() > 0)
report = {"bitwise_equal": bool(flags.item()), "freed": freed, "restored": restored, "shard_bytes": expected,
          "host_bytes": [b for b, _ in buffers], "same_buffers": all(ptrs == buffers[0][1] for _, ptrs in buffers)}
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
exit_ranks()
