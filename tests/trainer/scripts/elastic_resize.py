"""4 ranks, trainer placements 2x2 and 1x2 (dp_replicate x dp_shard): does resizing the replica dimension
change the training? Writes a JSON report to argv[1]. With argv[2] == "tied", the tiny model with its LM head
tied to the embedding (as Qwen3 0.6B-4B), and only the fixed, shrink and grow runs.

Every run trains the same global batch per step, cut into 4 virtual data-parallel ranks (2 replicas x 2
shards, the largest placement); the rank at (replica r, shard s) of an n-replica placement serves virtual
ranks r, r + n, ... of shard s, in replica order. Runs (6 steps each):

  fixed      2x2 throughout
  shrink     2x2, 2 steps -> 1x2, 2 steps -> 2x2, 2 steps (ranks 2, 3 free their shards, then receive them)
  grow       1x2, 3 steps -> 2x2, 3 steps (ranks 2, 3 never trained before: materialize, then receive)
  fine       as shrink, with two micro-batches per virtual rank (the sums associate differently)

The KL penalty is on (the frozen reference moves too) and each step makes two minibatch updates.
"""

import dataclasses
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

from reflow.config.job_config import JobConfig
from reflow.distributed import build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.recipe import load_recipe, resolve_path
from reflow.trainer.batch import pack
from reflow.trainer.elastic import shard_tensors
from reflow.trainer.policy import PolicyTrainer

rank, world, device = init_distributed()
assert world == 4
SHARD, MOST = 2, 2
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
TIED = len(sys.argv) > 2 and sys.argv[2] == "tied"
if TIED:
    # the tiny checkpoint without its LM head, declared tied: the head is the embedding
    from safetensors.torch import load_file, save_file

    tied_dir = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "tiny-qwen3-tied")
    if rank == 0:
        shutil.copytree(hf_dir, tied_dir)
        weights = load_file(os.path.join(hf_dir, "model.safetensors"))
        del weights["lm_head.weight"]
        save_file(weights, os.path.join(tied_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tied_dir, "config.json")) as f:
            hf_config = json.load(f)
        hf_config["tie_word_embeddings"] = True
        with open(os.path.join(tied_dir, "config.json"), "w") as f:
            json.dump(hf_config, f)
    dist.barrier()
    hf_dir = tied_dir
    recipe = dataclasses.replace(recipe, architecture=dataclasses.replace(recipe.architecture, tie_embeddings=True))
layouts = build_trainer_layouts(world, SHARD, [2, 1])


def config(micro_batch_size: int) -> JobConfig:
    cfg = JobConfig()
    cfg.training.lr = 2e-3
    cfg.kl.coef = 0.05
    cfg.training.num_minibatches = 2
    cfg.training.micro_batch_size = micro_batch_size
    cfg.weight_sync.bucket_size_mb = 0.25  # several buckets
    return cfg


def virtual_batches(step: int):
    """The step's global batch: 4 virtual ranks x 4 rows of random tokens, lengths 3..12, made-up advantages."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(MOST * SHARD):
        prompts, outputs, lps, versions, advs = [], [], [], [], []
        for _ in range(4):
            n = int(torch.randint(3, 13, (1,), generator=gen))
            prompts.append(torch.randint(3, 30, (4,), generator=gen).tolist())
            outputs.append(torch.randint(3, 30, (n,), generator=gen).tolist())
            lps.append((-torch.rand(n, generator=gen) * 3).tolist())
            versions.append([0] * n)
            advs.append(float(torch.randn(1, generator=gen)))
        out.append(pack(prompts, outputs, lps, versions, advs, [1.0] * 4, [0.0] * 4, 0))
    return out


def mine(trainer: PolicyTrainer, step: int):
    replica, shard = divmod(rank, SHARD)
    n = trainer.layout.replicas
    chunks = virtual_batches(step)
    return [chunks[v * SHARD + shard] for v in range(replica, MOST, n)]


def run(schedule: list[tuple[int, int]], micro_batch_size: int = 2):
    """schedule: (replicas, steps) phases. Returns this rank's state before training and after each phase
    (None while out of the trainer pool), and the transitions."""
    trainer = PolicyTrainer.from_config(config(micro_batch_size), recipe, hf_dir, layouts, schedule[0][0], device)
    snapshots, transitions, step = [], [], 0
    initial = [t.clone() for t in shard_tensors(trainer.model, trainer.optimizer, trainer.ref_model)] if trainer.active else None
    for replicas, steps in schedule:
        if replicas != trainer.layout.replicas:
            dist.barrier()
            t0 = time_now()
            report = dataclasses.asdict(trainer.resize(replicas, bucket_bytes=int(0.25 * 2**20)))
            report["seconds"] = slowest(time_now() - t0)
            report["bytes_moved"] = total(report["bytes_moved"])
            report["bytes_freed"] = total(report["bytes_freed"])
            report["copied_not_aliased"] = total(len(report["copied_not_aliased"]))
            transitions.append(report)
        for _ in range(steps):
            if trainer.active:
                trainer.train_step(mine(trainer, step))
            step += 1
        snapshots.append([t.clone() for t in shard_tensors(trainer.model, trainer.optimizer, trainer.ref_model)]
                         if trainer.active else None)
        transitions.append({"active_ranks": active_ranks(trainer.active)})
        if trainer.active and TIED:  # one parameter for the embedding and the LM head, in every placement
            assert trainer.model.tok_embeddings.weight is trainer.model.lm_head.weight
            assert len(trainer.optimizer.param_groups[0]["params"]) == len(list(trainer.model.parameters()))
    return initial, snapshots, transitions


def active_ranks(active: bool) -> list[int]:
    flags = [None] * world
    dist.all_gather_object(flags, active)
    return [r for r, flag in enumerate(flags) if flag]


def time_now() -> float:
    import time

    return time.perf_counter()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def total(count: int) -> int:
    t = torch.tensor([count], dtype=torch.long)
    dist.all_reduce(t)
    return int(t.item())


def compare(a, b) -> tuple[bool, float]:
    """Bitwise equal on every rank (and the largest difference), over all tensors both hold."""
    if a is None or b is None:
        flags = torch.tensor([1.0, 0.0], dtype=torch.float64)
    else:
        equal = all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
        worst = max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.numel()), default=0.0)
        flags = torch.tensor([1.0 if equal else 0.0, worst], dtype=torch.float64)
    mins = flags[:1].clone()
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    dist.all_reduce(flags[1:], op=dist.ReduceOp.MAX)
    return bool(mins.item()), flags[1].item()


initial, fixed, _ = run([(2, 2), (2, 2), (2, 2)])
_, shrink, shrink_moves = run([(2, 2), (1, 2), (2, 2)])
_, grow, grow_moves = run([(1, 2), (1, 1), (2, 3)])
report = {
    # after every phase, on every rank that holds a shard in both runs
    "shrink_equal": [compare(a, b) for a, b in zip(shrink, fixed)],
    "grow_equal_final": compare(grow[-1], fixed[-1]),
    "moved": compare(fixed[-1][:1] if fixed[-1] else None, initial[:1] if initial else None),  # a parameter
    "shrink_transitions": shrink_moves,
    "grow_transitions": grow_moves,
}
if not TIED:
    _, fine, _ = run([(2, 2), (1, 2), (2, 2)], micro_batch_size=1)
    _, fixed_fine, _ = run([(2, 2), (2, 2), (2, 2)], micro_batch_size=1)
    report["fine_vs_fixed"] = compare(fine[-1], fixed_fine[-1])
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
exit_ranks()
