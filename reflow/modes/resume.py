"""Checkpoints and resume of a decoupled run's replay state (the protocol's last section,
``docs/decoupled_protocol.md``): what each shard saves, where the prompt stream stands, who restores what.

A checkpoint, taken by the trainer ranks at the end of a step, holds each shard's buffer and the prompt
stream's position: the frontier (one past the furthest draw any shard received) and the holes below it
(draws admitted but not received: in flight at the checkpoint). Nothing in flight is saved. A resumed run
deals the holes to the rollout workers first, then continues from the frontier, so every prompt is generated
once and no sample is trained fresh twice. Restored samples count against no budget (origin -1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from reflow.types import Sample

if TYPE_CHECKING:
    from reflow.modes.trainer_shard import TrainerShard


@dataclass(frozen=True)
class StreamPosition:
    frontier: int
    """One past the furthest draw delivered to a shard."""
    holes: tuple[int, ...]
    """Draws below the frontier that no shard holds as trained or replayable: generated again on resume."""


def stream_position(
    frontier: int, holes: list[int], shards: list[tuple[set[int], set[int]]]
) -> StreamPosition:
    """Where the prompt stream stands at a checkpoint. ``frontier`` and ``holes``: the run's position when it
    (re)started; ``shards``: per trainer shard, (draws it received over the run, draws it gives back to be
    generated again). A group's samples may sit in two shards after a move: its draw is a hole if any shard
    gives it back."""
    received = set().union(*(draws for draws, _ in shards))
    delivered = received - set().union(*(regenerated for _, regenerated in shards))
    new_frontier = max([frontier - 1, *received]) + 1
    candidates = set(holes) | set(range(frontier, new_frontier))
    return StreamPosition(new_frontier, tuple(sorted(candidates - delivered)))


def shard_files(buffer, regenerate: bool) -> tuple[dict, set[int]]:
    """One shard's saved state, and the draws it gives back. ``regenerate`` (one_step_off, whose induction
    starts from the version the run resumes at): no unused sample is saved, their prompts become holes."""
    unused = [] if regenerate else buffer.unused
    regenerated = {sample.draw for sample in buffer.unused} if regenerate else set()
    return {"unused": unused, "replayable": buffer.replayable, "rng": buffer.rng.getstate()}, regenerated


def restored_share(saved: dict[str, dict], shard_index: int, num_shards: int) -> tuple[list[Sample], object | None]:
    """This shard's share of the saved buffers: saved shard k goes to shard k mod A (the same shard when the
    placement is the saved one), with origin -1; and the random state of the saved shard of its own index."""
    samples: list[Sample] = []
    rng_state = None
    for name, state in saved.items():
        saved_index = int(name.removeprefix("replay-shard"))
        if saved_index % num_shards != shard_index:
            continue
        for sample in state["unused"] + state["replayable"]:
            sample.origin = -1
            samples.append(sample)
        if saved_index == shard_index:
            rng_state = state["rng"]
    return samples, rng_state


def save_shard(shard: "TrainerShard", frontier: int, holes: list[int], regenerate: bool, group) -> tuple[StreamPosition, dict]:
    """A trainer rank at a checkpoint: its shard's saved state, and the prompt stream's position after one
    all-gather over the trainer ``group`` of the draws each shard received and gives back."""
    saved, regenerated = shard_files(shard.buffer, regenerate)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (shard.received_draws, regenerated), group=group)
    return stream_position(frontier, holes, gathered), saved


def restore_shard(shard: "TrainerShard", saved: dict[str, dict], num_shards: int, ledger: dict) -> int:
    """A trainer rank on resume: its share of the saved buffers (``restored_share``) into its shard, each sample
    in the ledger; returns how many."""
    samples, rng_state = restored_share(saved, shard.index, num_shards)
    shard.restore(samples, rng_state)
    ledger["restored"].extend(
        {"uid": x.uid, "use_count": x.use_count, "versions": x.versions, "advantage": x.advantage} for x in samples
    )
    return len(samples)
