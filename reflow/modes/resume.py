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

import torch
import torch.distributed as dist

from reflow.types import Sample

if TYPE_CHECKING:
    from reflow.modes.leader import Leader
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


def replay_checkpoint(
    shard: "TrainerShard", frontier: int, holes: list[int], *, regenerate: bool, group, leader: "Leader | None",
) -> tuple[int, dict[str, object]]:
    """A trainer rank's part of a decoupled checkpoint: the prompt stream's frontier (``prompts_drawn``) and this
    rank's files: its shard's buffer, and on the leader (rank 0) the stream's position and the placement
    controller's memory. Every trainer rank calls it at the same point (one all-gather)."""
    position, saved = save_shard(shard, frontier, holes, regenerate, group)
    files: dict[str, object] = {f"replay-shard{shard.index}": saved}
    if leader is not None:
        files["prompt-stream"] = {"frontier": position.frontier, "holes": list(position.holes)}
        controller = leader.controller_state()
        if controller is not None:
            files["placement-controller"] = controller
    return position.frontier, files


def restore_replay_state(
    checkpoints, shard: "TrainerShard | None", num_shards: int, ledger: dict, leader: "Leader | None", log,
) -> StreamPosition | None:
    """Every rank after the trainer's state was loaded: the leader's placement controller memory, this trainer
    shard's share of the saved buffers (``restore_shard``), and the prompt stream's position, which it returns
    (None when the checkpoint has none: sync mode's). ``log(line)`` says what was restored (one all-reduce)."""
    stream = checkpoints.read_files("prompt-stream").get("prompt-stream")
    if stream is None:
        return None
    controller = checkpoints.read_files("placement-controller").get("placement-controller")
    if leader is not None and controller is not None:
        refused = leader.load_controller_state(controller)
        if refused is not None:
            log(refused)
    position = StreamPosition(stream["frontier"], tuple(stream["holes"]))
    restored = restore_shard(shard, checkpoints.read_files("replay-shard"), num_shards, ledger) if shard is not None else 0
    count = torch.tensor([restored], dtype=torch.long)
    dist.all_reduce(count)
    log(
        f"restored {int(count.item())} replay-buffer samples; {len(position.holes)} prompts admitted but not "
        f"delivered at the checkpoint are generated again; the stream continues at draw {position.frontier}"
    )
    return position
