"""The replay buffer: one shard per trainer rank, a sampler and a replay filter (typed extension points)."""

from reflow.replay.buffer import BatchPlan, ReplayBuffer
from reflow.replay.policies import (
    FILTERS,
    SAMPLERS,
    AcceptAll,
    MediumRewardSampler,
    NonzeroAdvantage,
    RandomSampler,
    ReplayFilter,
    RewardBand,
    Sampler,
    build_filter,
    build_sampler,
)

__all__ = [
    "AcceptAll",
    "BatchPlan",
    "FILTERS",
    "MediumRewardSampler",
    "NonzeroAdvantage",
    "RandomSampler",
    "ReplayBuffer",
    "ReplayFilter",
    "RewardBand",
    "SAMPLERS",
    "Sampler",
    "build_filter",
    "build_sampler",
]
