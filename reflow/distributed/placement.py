"""Placement: which ranks train and which ranks generate.

    trainer pool:  HSDP mesh  dp_replicate = n_T  x  dp_shard = s_T   (A = n_T * s_T ranks)
    rollout pool:  n_R vLLM engines, TP = s_R each                      (R = n_R * s_R ranks)

Trainer ranks come first (0 .. A-1), rollout ranks after them. With
``num_rollout_ranks = 0`` the placement is colocated: every rank trains and
generates (the ``sync`` mode).
"""

from __future__ import annotations

from typing import Callable

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    world_size: int
    replicate_degree: int
    shard_degree: int
    num_rollout_ranks: int

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

    def is_trainer(self, rank: int) -> bool:
        return rank < self.num_trainer_ranks

    def is_rollout(self, rank: int) -> bool:
        return self.colocated or rank >= self.num_trainer_ranks

    @property
    def name(self) -> str:
        """Short form: trainer replicas x shard degree, plus rollout ranks ("T2x1+R2")."""
        return f"T{self.replicate_degree}x{self.shard_degree}+R{self.num_rollout_ranks}"

    def describe(self) -> str:
        roll = "colocated" if self.colocated else f"{self.num_rollout_ranks} rollout ranks {self.rollout_ranks}"
        return (
            f"world {self.world_size}: trainer HSDP {self.replicate_degree}x{self.shard_degree} "
            f"ranks {self.trainer_ranks}; {roll}"
        )


def build_placement(
    world_size: int, replicate: int, shard: int, num_rollout: int, where: Callable[[str], str] = lambda key: "placement"
) -> Placement:
    """Validate a placement against the world size; errors name the key and where it was set (``where(key)``)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if num_rollout < 0 or num_rollout >= world_size:
        raise ValueError(
            f"{where('placement.num_rollout_ranks')}: 'placement.num_rollout_ranks' = {num_rollout} must be in [0, world size {world_size}) "
            "(at least one trainer rank is needed)"
        )
    if replicate < 1:
        raise ValueError(f"{where('placement.trainer_replicate_degree')}: 'placement.trainer_replicate_degree' must be >= 1, got {replicate}")
    trainers = world_size - num_rollout
    if shard == -1:
        if trainers % replicate:
            raise ValueError(
                f"{where('placement.trainer_replicate_degree')}: {trainers} trainer ranks (world {world_size} - {num_rollout} rollout) are not divisible by "
                f"'placement.trainer_replicate_degree' = {replicate}"
            )
        shard = trainers // replicate
    if shard < 1:
        raise ValueError(f"{where('placement.trainer_shard_degree')}: 'placement.trainer_shard_degree' must be >= 1 or -1, got {shard}")
    if replicate * shard + num_rollout != world_size:
        raise ValueError(
            f"{where('placement.trainer_shard_degree')}: placement does not match the world size: trainer_replicate_degree {replicate} x "
            f"trainer_shard_degree {shard} + num_rollout_ranks {num_rollout} = {replicate * shard + num_rollout}, "
            f"but torchrun started {world_size} ranks"
        )
    return Placement(world_size, replicate, shard, num_rollout)


def feasible_placements(world_size: int, shard_degree: int, colocated: bool) -> list[Placement]:
    """Every placement of ``world_size`` ranks with this trainer shard degree: n replicas of the shard
    group and the remaining ranks generating (at least one in the decoupled modes; none when colocated)."""
    if colocated:
        if world_size % shard_degree:
            return []
        return [Placement(world_size, world_size // shard_degree, shard_degree, 0)]
    return [
        Placement(world_size, replicas, shard_degree, world_size - replicas * shard_degree)
        for replicas in range(1, (world_size - 1) // shard_degree + 1)
    ]
