"""Replay buffer invariants: the sigma cap, the fresh floor, delta eviction, the filters and samplers."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.replay import (
    AcceptAll,
    BufferedSample,
    MediumRewardSampler,
    NonzeroAdvantage,
    RandomSampler,
    ReplayBuffer,
    RewardBand,
    build_filter,
    build_sampler,
)
from reflow.replay.buffer import max_replay, min_fresh


def sample(i, version=0, reward=0.5, adv=1.0, group_mean=0.5):
    return BufferedSample(
        uid=f"s{i}", draw=i // 4, group_id=f"g{i // 4}", prompt_ids=[1], output_ids=[5, 2], logprobs=[-0.1, -0.2],
        versions=[version, version], reward=reward, advantage=adv, group_reward_mean=group_mean,
    )


def test_fresh_floor_and_sigma_cap_by_hand():
    buf = ReplayBuffer(sigma=0.25, delta=4, sampler=RandomSampler(), replay_filter=AcceptAll())
    assert (min_fresh(8, 0.25), max_replay(8, 0.25)) == (6, 2)
    buf.add([sample(i) for i in range(5)])
    assert buf.plan_batch(8, 0) is None  # 5 < 6 unused: the trainer waits
    buf.add([sample(5)])
    plan = buf.plan_batch(8, 0)
    assert len(plan.fresh) == 6 and plan.replayed == []  # nothing replayable yet
    buf.give_back(plan)
    buf.add([sample(10 + i) for i in range(6)])
    plan = buf.plan_batch(8, 0)
    assert len(plan.fresh) == 6 and len(plan.replayed) == 2 and plan.replay_fraction == 0.25
    assert all(s.use_count == 1 for s in plan.replayed)


def test_all_fresh_when_production_keeps_up():
    buf = ReplayBuffer(sigma=0.5, delta=4, sampler=RandomSampler(), replay_filter=AcceptAll())
    buf.add([sample(i) for i in range(8)])
    buf.give_back(buf.plan_batch(8, 0))
    buf.add([sample(100 + i) for i in range(20)])
    plan = buf.plan_batch(8, 0)
    assert len(plan.fresh) == 8 and plan.replayed == []


def test_delta_eviction():
    buf = ReplayBuffer(sigma=0.5, delta=2, sampler=RandomSampler(), replay_filter=AcceptAll())
    buf.add([sample(0, version=0), sample(1, version=1), sample(2, version=3)])
    assert [s.uid for s in buf.evict_stale(current_version=3)] == ["s0"]  # 3 - 0 > 2
    assert sorted(s.uid for s in buf.drain()) == ["s1", "s2"]
    # a partial rollout's staleness counts from its oldest token
    s = sample(9)
    s.versions = [1, 4]
    assert s.staleness(4) == 3


def test_min_staleness_trains_only_the_previous_versions_samples():
    """one_step_off's floor: at version v >= 1 only samples at least one version old are eligible, oldest
    first; at version 0 nothing can be older, so the first batch is served from version 0."""
    buf = ReplayBuffer(sigma=0.0, delta=1, sampler=RandomSampler(), replay_filter=AcceptAll(), min_staleness=1)
    buf.add([sample(i, version=0) for i in range(8)])
    plan = buf.plan_batch(4, 0)
    assert [s.uid for s in plan.fresh] == ["s0", "s1", "s2", "s3"]
    buf.add([sample(10 + i, version=1) for i in range(4)])  # the next policy's samples arrive first
    assert not buf.can_serve(8, 1) and buf.can_serve(4, 1)
    plan = buf.plan_batch(4, 1)
    assert [s.uid for s in plan.fresh] == ["s4", "s5", "s6", "s7"]  # version 0's, not version 1's
    assert buf.plan_batch(4, 1) is None  # version 1's samples are too fresh at version 1
    assert [s.uid for s in buf.plan_batch(4, 2).fresh] == ["s10", "s11", "s12", "s13"]
    with pytest.raises(ValueError, match="min_staleness"):
        ReplayBuffer(0.0, 1, RandomSampler(), AcceptAll(), min_staleness=2)


def test_filters():
    assert RewardBand(0.2, 0.8).keep(sample(0, reward=0.5)) and not RewardBand(0.2, 0.8).keep(sample(0, reward=1.0))
    assert not NonzeroAdvantage().keep(sample(0, adv=0.0)) and NonzeroAdvantage().keep(sample(0, adv=-0.3))
    buf = ReplayBuffer(0.5, 4, RandomSampler(), NonzeroAdvantage())
    buf.add([sample(0, adv=0.0), sample(1, adv=1.0)])
    assert buf.give_back(buf.plan_batch(2, 0)) == 1
    with pytest.raises(ValueError, match="replay.filter"):
        build_filter("nope")
    with pytest.raises(ValueError, match="filter_reward_low"):
        build_filter("reward_band", 0.9, 0.1)


def test_medium_reward_sampler_prefers_mixed_groups():
    cands = [sample(0, group_mean=1.0), sample(1, group_mean=0.5), sample(2, group_mean=0.0), sample(3, group_mean=0.6)]
    picked = MediumRewardSampler().select(cands, 2, random.Random(0))
    assert {s.uid for s in picked} == {"s1", "s3"}
    with pytest.raises(ValueError, match="replay.sampler"):
        build_sampler("nope")


@settings(max_examples=60, deadline=None)
@given(
    sigma=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75]),
    batch=st.integers(1, 16),
    arrivals=st.lists(st.integers(0, 20), min_size=1, max_size=25),
    sampler=st.sampled_from(["random", "medium_reward"]),
)
def test_batches_respect_bounds_and_lose_nothing(sigma, batch, arrivals, sampler):
    """Property: every batch has >= ceil(b(1-sigma)) fresh and <= floor(b sigma) replayed samples, no sample
    appears twice in a batch, and every sample is in exactly one place (pool, or consumed and dropped)."""
    buf = ReplayBuffer(sigma, delta=100, sampler=build_sampler(sampler), replay_filter=AcceptAll(), seed=1)
    made = 0
    for n in arrivals:
        buf.add([sample(made + i) for i in range(n)])
        made += n
        plan = buf.plan_batch(batch, 0)
        if plan is None:
            assert buf.num_unused < math.ceil(batch * (1 - sigma) - 1e-9)
            continue
        assert len(plan.fresh) >= math.ceil(batch * (1 - sigma) - 1e-9)
        assert len(plan.replayed) <= math.floor(batch * sigma + 1e-9)
        assert plan.size <= batch
        assert all(s.use_count == 0 for s in plan.fresh) and all(s.use_count > 0 for s in plan.replayed)
        uids = [s.uid for s in plan.fresh + plan.replayed]
        assert len(uids) == len(set(uids))
        buf.give_back(plan)
        # accept-all keeps every sample: nothing lost, nothing duplicated
        pool = [s.uid for s in buf.unused + buf.replayable]
        assert len(pool) == len(set(pool)) == made
