"""Replay buffer invariants: the sigma cap, the fresh floor, delta eviction, the filters and samplers."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.replay import (
    AcceptAll,
    MediumRewardSampler,
    NonzeroAdvantage,
    RandomSampler,
    ReplayBuffer,
    RewardBand,
    build_filter,
    build_sampler,
)
from reflow.replay.buffer import max_replay, min_fresh
from reflow.types import Sample


def sample(i, version=0, reward=0.5, adv=1.0, group_mean=0.5):
    return Sample(
        uid=f"s{i}", draw=i // 4, group_id=f"g{i // 4}", prompt_ids=[1], output_ids=[5, 2], logprobs=[-0.1, -0.2],
        versions=[version, version], reward=reward, advantage=adv, group_reward_mean=group_mean,
    )


def test_fresh_floor_and_sigma_cap_by_hand():
    buf = ReplayBuffer(sigma=0.25, delta=4, sampler=RandomSampler(), replay_filter=AcceptAll())
    assert (min_fresh(8, 0.25), max_replay(8, 0.25)) == (6, 2)
    buf.add([sample(i) for i in range(6)])
    assert buf.need(8) == 8 and buf.plan_batch(8, 0) is None  # nothing replayable yet: a whole batch needs 8 fresh
    buf.add([sample(6), sample(7)])
    plan = buf.plan_batch(8, 0)
    assert len(plan.fresh) == 8 and plan.replayed == []
    buf.give_back(plan)
    buf.add([sample(10 + i) for i in range(5)])
    assert buf.need(8) == 6 and buf.plan_batch(8, 0) is None  # 5 < 6 unused: the trainer waits
    buf.add([sample(15)])
    plan = buf.plan_batch(8, 0)
    assert len(plan.fresh) == 6 and len(plan.replayed) == 2 and plan.replay_fraction == 0.25
    assert all(s.use_count == 1 for s in plan.replayed)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.sampled_from([4, 8, 12]), sigma=st.sampled_from([0.0, 0.25, 0.5, 0.75]),
    arrivals=st.lists(st.integers(0, 9), min_size=1, max_size=12), seed=st.integers(0, 1000),
)
def test_a_batch_holds_exactly_b_whenever_fresh_and_replayable_can_fill_it(batch, sigma, arrivals, seed):
    """After any history of arrivals and steps, a batch is served exactly when ceil(b(1 - sigma)) fresh samples
    exist and fresh plus (at most floor(b sigma)) replayable ones reach b, and then it holds exactly b."""
    buf = ReplayBuffer(sigma=sigma, delta=100, sampler=RandomSampler(), replay_filter=AcceptAll(), seed=seed)
    uid = 0
    for count in arrivals:
        buf.add([sample(uid + k) for k in range(count)])
        uid += count
        fresh, replayable = buf.num_unused, len(buf.replayable)
        fits = fresh >= min_fresh(batch, sigma) and fresh + min(replayable, max_replay(batch, sigma)) >= batch
        assert buf.can_serve(batch, 0) == fits
        plan = buf.plan_batch(batch, 0)
        assert (plan is not None) == fits
        if plan is not None:
            assert plan.size == batch and len(plan.fresh) == min(fresh, batch)
            buf.give_back(plan)


def test_fresh_samples_are_taken_earliest_deadline_first():
    """Oldest anchor version first (the finish version by default), ties in arrival order."""
    buf = ReplayBuffer(sigma=0.0, delta=4, sampler=RandomSampler(), replay_filter=AcceptAll())
    arrivals = [(0, 3), (1, 1), (2, 3), (3, 2), (4, 1), (5, 2)]  # (uid, finish version)
    for i, finished in arrivals:
        s = sample(i, version=0)
        s.finish_version = finished
        buf.add([s])
    assert [s.uid for s in buf.plan_batch(4, 3).fresh] == ["s1", "s4", "s3", "s5"]
    assert buf.num_urgent(3) == 0 and buf.num_urgent(7) == 2  # staleness 4 = delta at version 7: s0, s2
    assert [s.uid for s in buf.take_eligible(-1, 1, 3)] == ["s2"]  # a donor gives away what it would train last
    assert [s.uid for s in buf.unused] == ["s0"]
    with pytest.raises(RuntimeError, match="holds 1"):
        buf.take_eligible(1, 1, 3)
    start = ReplayBuffer(sigma=0.0, delta=4, sampler=RandomSampler(), replay_filter=AcceptAll(), anchor="start")
    late, early = sample(0, version=2), sample(1, version=1)
    late.finish_version, early.finish_version = 2, 3
    start.add([late, early])
    assert [s.uid for s in start.plan_batch(2, 3).fresh] == ["s1", "s0"]  # anchored at the start: birth order


def test_staleness_counts_from_the_finish_version_unless_told_from_the_start():
    """A long answer begun at version 0 and finished at version 3 is fresh at version 4 with delta 2 (anchor
    finish), and stale from the start (4 - 0 > 2)."""
    long = sample(0)
    long.versions, long.finish_version = [0, 0, 1, 2, 3], 3
    finish = ReplayBuffer(sigma=0.0, delta=2, sampler=RandomSampler(), replay_filter=AcceptAll())
    start = ReplayBuffer(sigma=0.0, delta=2, sampler=RandomSampler(), replay_filter=AcceptAll(), anchor="start")
    assert (finish.staleness(long, 4), start.staleness(long, 4)) == (1, 4)
    assert long.head_lag(4) == 4
    for buf in (finish, start):
        buf.add([long])
    assert finish.evict_stale(4) == [] and start.evict_stale(4) == [long]
    assert finish.evict_stale(6) == [long]  # 6 - 3 > 2
    with pytest.raises(ValueError, match="staleness_from"):
        ReplayBuffer(0.0, 2, RandomSampler(), AcceptAll(), anchor="middle")


def test_old_head_tokens_are_masked_and_the_rest_trains():
    """A sample whose head is older than delta but whose group finished within delta trains: its tokens older
    than max_head_lag versions leave the loss, the newer ones stay."""
    from reflow.trainer.batch import mask_stale_tokens, to_batch

    buf = ReplayBuffer(sigma=0.0, delta=2, sampler=RandomSampler(), replay_filter=AcceptAll())
    long = sample(0)
    long.output_ids, long.logprobs = [5, 6, 7, 8, 9, 2], [-0.1] * 6
    long.versions, long.finish_version = [0, 0, 1, 3, 5, 5], 5
    short = sample(1, version=5)
    buf.add([long, short])
    plan = buf.plan_batch(2, 6)  # version 6: head lag 6 > delta, finished 1 version ago
    assert [s.uid for s in plan.fresh] == ["s0", "s1"]
    batch = to_batch(plan.fresh, pad_id=0)
    assert batch.num_tokens() == 8
    masked = mask_stale_tokens(batch, oldest_version=6 - 4)  # max_head_lag 4 = 2 x delta: versions 0, 0, 1 go
    assert masked == 3 and batch.num_tokens() == 5
    row = batch.loss_mask[0].nonzero().flatten().tolist()
    assert batch.versions[0, row].tolist() == [3, 5, 5]
    assert batch.loss_mask[1].sum().item() == 2  # the short sample keeps every token


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
    # counted from the start, a partial rollout's staleness counts from its oldest token
    s = sample(9)
    s.versions = [1, 4]
    assert s.staleness(4, "start") == 3 and s.staleness(4, "finish") == 0


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
        if plan is None:  # too few fresh samples, or too few to fill the batch with the replayable ones
            assert buf.num_unused < buf.need(batch)
            continue
        assert len(plan.fresh) >= math.ceil(batch * (1 - sigma) - 1e-9)
        assert len(plan.replayed) <= math.floor(batch * sigma + 1e-9)
        assert plan.size == batch
        assert all(s.use_count == 0 for s in plan.fresh) and all(s.use_count > 0 for s in plan.replayed)
        uids = [s.uid for s in plan.fresh + plan.replayed]
        assert len(uids) == len(set(uids))
        buf.give_back(plan)
        # accept-all keeps every sample: nothing lost, nothing duplicated
        pool = [s.uid for s in buf.unused + buf.replayable]
        assert len(pool) == len(set(pool)) == made
