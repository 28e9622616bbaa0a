"""A placement change of a decoupled run, on every rank after the step it follows (a sync point, where the
trainer ranks left their loop and rank 0 sent every rollout worker ``Transition``; the rollout workers hold
what they had in flight as partial rollouts, ``HeldGroup``). Why it cannot deadlock:
``docs/decoupled_protocol.md``, "Placement changes".

  1. rollout workers send FLUSH to every trainer rank; trainer ranks drain until they have FLUSH from every
     rollout worker, so each shard holds every sample addressed to it, and until every move has arrived
  2. the trainer resizes (staying ranks keep their shards, joining ranks receive theirs)
  3. leaving trainer shards hand their buffer to the staying shard of index (their index mod A'); nothing
     else can reach them: every group sent before the change arrived before FLUSH
  4. every rank learns the trainer's clock, how far each rollout worker drew the prompt stream and what it
     holds, and takes up the new placement's roles (prompt shares dealt without a gap, shards, budgets); the
     held groups are dealt by ``deal_groups``: a staying worker keeps its own, a leaving worker's go to the
     new workers holding the fewest sequences
  5. the new placement's weight sync puts the current weights into every engine that now generates
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from reflow.distributed.placement import build_placement
from reflow.scheduler.routing import deal_groups
from reflow.types import Flush, Handover

if TYPE_CHECKING:
    from reflow.modes.decoupled import DecoupledMode


def change_placement(mode: "DecoupledMode", replicas: int) -> dict:
    """Every rank: move ``mode`` to ``replicas`` trainer replicas; returns the transition's event row."""
    parts = mode.parts
    t0 = time.perf_counter()
    old = mode.placement
    new = build_placement(old.world_size, replicas, old.shard_degree, old.world_size - replicas * old.shard_degree,
                          rollout_tp=old.rollout_tp)
    # 1. flush the data plane into the shards (a tensor-parallel engine's followers sent nothing: they skip this)
    if mode.rank in mode.rollout_workers:
        for rank in mode.trainer_ranks:
            mode.outbox.put(rank, Flush())
    elif mode.is_trainer:
        while not set(mode.rollout_workers) <= mode.flushed:
            mode.receive()
            time.sleep(0.002)
        mode.flushed.clear()
        mode.settle_moves()
    # 2. the trainer's shards; a rank that joins the trainer puts its engine to sleep first (nothing is in flight:
    #    its worker held everything), so that the shards it receives find the engine's memory free
    joins = not old.is_trainer(mode.rank) and new.is_trainer(mode.rank) and not new.is_rollout(mode.rank)
    if joins:
        parts.engine.sleep()
    resized = parts.trainer.resize(replicas, bucket_bytes=int(parts.cfg.weight_sync.bucket_size_mb * 2**20))
    # 3. a leaving shard's samples go to a staying one (use counts and versions kept)
    if mode.is_trainer and not new.is_trainer(mode.rank):
        samples, draws = mode.shard.hand_over()
        heir = new.trainer_ranks[mode.shard.index % new.num_trainer_ranks]
        mode.outbox.put(heir, Handover(samples, draws))
        mode.shard = None
    # 4. the trainer's clock (a rank that generated did not count steps), the prompt shares as the rollout
    #    workers left them, then the new placement's roles and state
    clock = torch.tensor([mode.step, mode.version, mode.steps_done, mode._drawn], dtype=torch.long)
    dist.broadcast(clock, src=0)  # rank 0 trains in every placement
    mode.step, mode.version, mode.steps_done, mode._drawn = (int(x) for x in clock.tolist())
    mine = (mode.shares[mode.rollout_workers.index(mode.rank)], mode.carried) if mode.rank in mode.rollout_workers else None
    gathered = [None] * old.world_size
    dist.all_gather_object(gathered, mine)
    mode.shares = [gathered[rank][0] for rank in mode.rollout_workers]
    held = [gathered[rank][1] for rank in old.rollout_workers]
    stays = [new.rollout_workers.index(rank) if rank in new.rollout_workers else None for rank in old.rollout_workers]
    dealt = deal_groups([[len(group.held) for group in groups] for groups in held], stays, len(new.rollout_workers))
    mode.carried = []
    if mode.rank in new.rollout_workers:
        mode.carried = [held[worker][k] for worker, k in dealt[new.rollout_workers.index(mode.rank)]]
    mode.enter(new)  # (the budgets start afresh: no sample a shard holds counts against one of the old placement's)
    # 5. weights into every engine that generates now (an engine that was asleep wakes in load_weights)
    mode.weight_sync.sync(parts.trainer if mode.is_trainer else None, parts.engine, mode.version)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    moved = torch.tensor([resized.bytes_moved], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(moved)
    return {
        "transition": f"{old.name} -> {new.name}", "direction": resized.direction if mode.rank == 0 else "",
        "placement": new.name, "transition_s": seconds.item(), "bytes_moved": int(moved.item()), "after_step": mode.step,
    }
