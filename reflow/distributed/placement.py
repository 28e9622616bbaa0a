"""Placement: which ranks train and which ranks generate.

    trainer pool:  HSDP mesh  dp_replicate = n_T  x  dp_shard = s_T   (A = n_T * s_T ranks)
    rollout pool:  n_R vLLM engines, TP = s_R each                      (R = n_R * s_R ranks)

Trainer ranks come first (0 .. A-1), rollout ranks after them. With
``num_rollout_ranks = 0`` the placement is colocated: every rank trains and
generates (the ``sync`` mode).

Rollout tensor parallelism (``rollout.tensor_parallel_degree`` = s_R > 1): every rank holds its part of
one engine over the aligned block of s_R ranks it sits in (ranks k s_R .. (k + 1) s_R - 1, vLLM's layout),
so the world is a multiple of s_R and the rollout pool is a whole number of blocks: placements move rollout
workers in units of s_R. A block's first rank is its rollout worker (``rollout_workers``); the others
replay its engine calls (``reflow.rollout.tensor_parallel``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


def placement_name(replicas: int, shard_degree: int, rollout_ranks: int, rollout_tp: int = 1) -> str:
    """The one spelling of a placement, live and simulated: trainer replicas x shard degree, plus rollout ranks
    ("T2x1+R2"), or rollout engines x their tensor-parallel degree ("T2x1+R1x2")."""
    rollout = f"{rollout_ranks // rollout_tp}x{rollout_tp}" if rollout_tp > 1 else str(rollout_ranks)
    return f"T{replicas}x{shard_degree}+R{rollout}"


def parse_placement_name(name: str) -> "Placement":
    """The inverse of ``placement_name``: the ``Placement`` it names (its world: the trainer ranks and the rollout
    ranks, which a colocated placement's "R0" adds nothing to); a string it did not write is one clear error."""
    match = _PLACEMENT_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a placement name (T<replicas>x<shard degree>+R<rollout ranks>[x<tp>])")
    replicas, shard, engines, tp = (int(group) if group else 1 for group in match.groups())
    return Placement(replicas * shard + engines * tp, replicas, shard, engines * tp, tp)


_PLACEMENT_NAME = re.compile(r"T(\d+)x(\d+)\+R(\d+)(?:x(\d+))?")


@dataclass(frozen=True)
class Placement:
    world_size: int
    replicate_degree: int
    shard_degree: int
    num_rollout_ranks: int
    rollout_tp: int = 1
    """s_R: ranks per vLLM engine."""

    @property
    def num_trainer_ranks(self) -> int:
        return self.replicate_degree * self.shard_degree

    @property
    def colocated(self) -> bool:
        return self.num_rollout_ranks == 0

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(self.num_trainer_ranks))

    @property
    def rollout_ranks(self) -> list[int]:
        if self.colocated:
            return list(range(self.world_size))
        return list(range(self.num_trainer_ranks, self.world_size))

    @property
    def rollout_workers(self) -> list[int]:
        """The first rank of every rollout engine (every rollout rank without tensor parallelism)."""
        return self.rollout_ranks[:: self.rollout_tp]

    def tp_block(self, rank: int) -> list[int]:
        """The ranks of the engine ``rank`` is part of."""
        first = rank - rank % self.rollout_tp
        return list(range(first, first + self.rollout_tp))

    def is_trainer(self, rank: int) -> bool:
        return rank < self.num_trainer_ranks

    def is_rollout(self, rank: int) -> bool:
        return self.colocated or rank >= self.num_trainer_ranks

    @property
    def name(self) -> str:
        """Short form: trainer replicas x shard degree, plus rollout ranks ("T2x1+R2"), or rollout engines x
        their tensor-parallel degree ("T2x1+R1x2")."""
        return placement_name(self.replicate_degree, self.shard_degree, self.num_rollout_ranks, self.rollout_tp)

    def describe(self) -> str:
        roll = "colocated" if self.colocated else f"{self.num_rollout_ranks} rollout ranks {self.rollout_ranks}"
        if self.rollout_tp > 1:
            roll += f" ({self.num_rollout_ranks // self.rollout_tp} engines of tensor-parallel degree {self.rollout_tp})"
        return (
            f"world {self.world_size}: trainer HSDP {self.replicate_degree}x{self.shard_degree} "
            f"ranks {self.trainer_ranks}; {roll}"
        )


def build_placement(
    world_size: int, replicate: int, shard: int, num_rollout: int, where: Callable[[str], str] = lambda key: "placement",
    rollout_tp: int = 1,
) -> Placement:
    """Validate a placement against the world size; errors name the key and where it was set (``where(key)``)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if rollout_tp < 1:
        raise ValueError(f"{where('rollout.tensor_parallel_degree')}: 'rollout.tensor_parallel_degree' must be >= 1, "
                         f"got {rollout_tp}")
    if rollout_tp > 1 and (world_size % rollout_tp or num_rollout % rollout_tp):
        raise ValueError(
            f"{where('placement.num_rollout_ranks')}: with 'rollout.tensor_parallel_degree' = {rollout_tp}, the world "
            f"({world_size} ranks) and 'placement.num_rollout_ranks' ({num_rollout}) must be multiples of it: each "
            "engine spans an aligned block of that many ranks"
        )
    if num_rollout < 0 or num_rollout >= world_size:
        raise ValueError(
            f"{where('placement.num_rollout_ranks')}: 'placement.num_rollout_ranks' = {num_rollout} must be in "
            f"[0, world size {world_size}) "
            "(at least one trainer rank is needed)"
        )
    if replicate < 1:
        raise ValueError(f"{where('placement.trainer_replicate_degree')}: 'placement.trainer_replicate_degree' must be >= 1, "
                         f"got {replicate}")
    trainers = world_size - num_rollout
    if shard == -1:
        if trainers % replicate:
            raise ValueError(
                f"{where('placement.trainer_replicate_degree')}: {trainers} trainer ranks (world {world_size} - "
                f"{num_rollout} rollout) are not divisible by "
                f"'placement.trainer_replicate_degree' = {replicate}"
            )
        shard = trainers // replicate
    if shard < 1:
        raise ValueError(f"{where('placement.trainer_shard_degree')}: 'placement.trainer_shard_degree' must be >= 1 or -1, "
                         f"got {shard}")
    if replicate * shard + num_rollout != world_size:
        raise ValueError(
            f"{where('placement.trainer_shard_degree')}: placement does not match the world size: "
            f"trainer_replicate_degree {replicate} x "
            f"trainer_shard_degree {shard} + num_rollout_ranks {num_rollout} = {replicate * shard + num_rollout}, "
            f"but torchrun started {world_size} ranks"
        )
    return Placement(world_size, replicate, shard, num_rollout, rollout_tp)


def feasible_placements(world_size: int, shard_degree: int, colocated: bool, rollout_tp: int = 1) -> list[Placement]:
    """Every placement of ``world_size`` ranks with this trainer shard degree: n replicas of the shard
    group and the remaining ranks generating (at least one engine of ``rollout_tp`` ranks in the decoupled
    modes, a whole number of them; none when colocated)."""
    if colocated:
        if world_size % shard_degree:
            return []
        return [Placement(world_size, world_size // shard_degree, shard_degree, 0)]
    return [
        Placement(world_size, replicas, shard_degree, world_size - replicas * shard_degree, rollout_tp)
        for replicas in range(1, (world_size - 1) // shard_degree + 1)
        if (world_size - replicas * shard_degree) % rollout_tp == 0
    ]
