"""Replay policies: which replayed samples fill a batch (Sampler) and which consumed samples go back (ReplayFilter).

Both are small Protocols; built-ins are chosen by name from the explicit dicts at the bottom.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from reflow.types import Sample


@runtime_checkable
class Sampler(Protocol):
    def select(self, candidates: list["Sample"], k: int, rng: random.Random) -> list["Sample"]:
        """Choose at most k of the candidates (already-used samples still in the pool)."""
        ...


@runtime_checkable
class ReplayFilter(Protocol):
    def keep(self, sample: "Sample") -> bool:
        """After a sample is consumed: may it be replayed later?"""
        ...


class RandomSampler:
    """Uniform over the replayable pool."""

    def select(self, candidates, k, rng):
        return rng.sample(candidates, min(k, len(candidates)))


class MediumRewardSampler:
    """Prefer samples whose group is neither all-right nor all-wrong (|reward - group mean| large, mean mid-range).

    Score = 1 - |2 * group_mean - 1| (1 for a group mean of 0.5, 0 for 0 or 1); ties broken at random."""

    def select(self, candidates, k, rng):
        keyed = [(1.0 - abs(2.0 * c.group_reward_mean - 1.0), rng.random(), i) for i, c in enumerate(candidates)]
        keyed.sort(reverse=True)
        return [candidates[i] for _, _, i in keyed[:k]]


class AcceptAll:
    def keep(self, sample):
        return True


class RewardBand:
    """Keep samples whose reward lies in [low, high]."""

    def __init__(self, low: float = 0.0, high: float = 1.0):
        if low > high:
            raise ValueError(f"replay.filter_reward_low ({low}) must be <= replay.filter_reward_high ({high})")
        self.low, self.high = low, high

    def keep(self, sample):
        return self.low <= sample.reward <= self.high


class NonzeroAdvantage:
    """Keep samples that still carry a learning signal (|advantage| > eps)."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def keep(self, sample):
        return abs(sample.advantage) > self.eps


SAMPLERS: dict[str, type] = {"random": RandomSampler, "medium_reward": MediumRewardSampler}
FILTERS: dict[str, type] = {"accept_all": AcceptAll, "reward_band": RewardBand, "nonzero_advantage": NonzeroAdvantage}


def build_sampler(name: str) -> Sampler:
    if name not in SAMPLERS:
        raise ValueError(f"replay.sampler: unknown sampler {name!r} (known: {', '.join(SAMPLERS)})")
    return SAMPLERS[name]()


def build_filter(name: str, low: float = 0.0, high: float = 1.0) -> ReplayFilter:
    if name not in FILTERS:
        raise ValueError(f"replay.filter: unknown filter {name!r} (known: {', '.join(FILTERS)})")
    if name == "reward_band":
        return RewardBand(low, high)
    return FILTERS[name]()
