"""The dispatch rule: shares, the window and per-step limits, and a protocol simulation of every decoupled mode
in which the real DispatchBudget and ReplayBuffer meet arbitrary finish orders (long tails included)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.replay import AcceptAll, BufferedSample, RandomSampler, ReplayBuffer
from reflow.scheduler import DispatchBudget, DispatchRule, share_groups


@pytest.mark.parametrize("total,num_rollout,num_shards", [(8, 1, 1), (8, 2, 2), (3, 3, 2), (7, 3, 2), (16, 4, 4), (5, 2, 3)])
def test_shares_are_balanced_over_shards_and_rollout_ranks(total, num_rollout, num_shards):
    shares = share_groups(total, num_rollout, num_shards)
    per_shard = [sum(row[a] for row in shares) for a in range(num_shards)]
    per_rollout = [sum(row) for row in shares]
    assert sum(per_shard) == total
    assert max(per_shard) - min(per_shard) <= 1 and max(per_rollout) - min(per_rollout) <= 1


def test_window_grants_exactly_what_was_retired():
    # window 4 groups of 2 over 1 rollout rank and 2 shards: 2 groups (4 samples) per shard
    budget = DispatchBudget(DispatchRule(window=8), 0, 1, 2, group_size=2)
    shards = []
    while (shard := budget.next_shard()) is not None:
        budget.record_start(shard)
        shards.append(shard)
    assert shards == [0, 1, 0, 1]  # round robin
    assert [budget.outstanding(a) for a in range(2)] == [4, 4]
    budget.update(steps_done=5, retired=[2, 0])  # steps do not matter to a window
    assert budget.next_shard() == 0 and budget.room(0) == 2 and budget.room(1) == 0
    budget.record_start(0)
    assert budget.next_shard() is None
    budget.update(steps_done=4, retired=[1, 0])  # an older word changes nothing: counts are cumulative
    assert budget.room(0) == 0
    with pytest.raises(RuntimeError, match="no room"):
        budget.record_start(1)


def test_per_step_grants_b_max_per_trainer_step_whatever_was_consumed():
    budget = DispatchBudget(DispatchRule(per_step=8), 1, 2, 1, group_size=2, start_step=10)  # resumed at step 10
    assert budget.allowance(0) == 4  # rank 1 of 2: half of B_max before the first step
    budget.update(steps_done=10, retired=[4])
    assert budget.allowance(0) == 4  # retirements do not matter to B_max
    budget.update(steps_done=12, retired=[4])
    assert budget.allowance(0) == 12


def test_both_limits_take_the_smaller():
    budget = DispatchBudget(DispatchRule(window=4, per_step=2), 0, 1, 1, group_size=2)
    assert budget.allowance(0) == 2
    budget.update(steps_done=5, retired=[0])
    assert budget.allowance(0) == 4


def test_rule_needs_a_limit():
    with pytest.raises(ValueError, match="window or a per-step"):
        DispatchRule()
    with pytest.raises(ValueError, match=">= 0"):
        DispatchRule(window=-1)


# ---------------------------------------------------------------- protocol simulation


def simulate(mode, rng, *, prompts=4, group=2, num_rollout=1, num_shards=1, delta=1, interval=1, steps=12, sigma=0.0):
    """Rollout ranks with a real DispatchBudget, trainer shards with a real ReplayBuffer, the protocol's order
    (SyncWeights, then Progress after every step), and groups that finish in a random order, some much later
    (a long tail). Returns, per step, the staleness of every fresh sample trained."""
    batch = prompts * group
    if mode == "one_step_off":
        rule, min_staleness, delta, interval = DispatchRule(window=2 * batch), 1, 1, 1
    elif mode == "async":
        rule, min_staleness = DispatchRule(window=(delta - interval + 2) * batch), 0
    else:
        rule, min_staleness = DispatchRule(per_step=batch), 0
    budgets = [DispatchBudget(rule, r, num_rollout, num_shards, group) for r in range(num_rollout)]
    buffers = [ReplayBuffer(sigma, delta, RandomSampler(), AcceptAll(), seed=a, min_staleness=min_staleness) for a in range(num_shards)]
    retired = [[0] * num_shards for _ in range(num_rollout)]
    in_flight: list[tuple[int, int, int, int]] = []  # (rollout, shard, birth version, group id)
    version = engine_version = steps_done = made = 0
    per_shard = batch // num_shards
    trained: list[list[int]] = []
    while steps_done < steps:
        # rollout ranks admit everything their budget allows, on the engine's current weights
        for r, budget in enumerate(budgets):
            while (shard := budget.next_shard()) is not None:
                budget.record_start(shard)
                in_flight.append((r, shard, engine_version, made))
                made += 1
        # trainer shards: evict what went stale (retiring unused samples), then step if all can serve
        for a, buf in enumerate(buffers):
            for s in buf.evict_stale(version):
                if s.use_count == 0:
                    retired[s.origin][a] += 1
        if all(buf.can_serve(per_shard, version) for buf in buffers):
            ages = []
            for a, buf in enumerate(buffers):
                plan = buf.plan_batch(per_shard, version)
                ages += [s.staleness(version) for s in plan.fresh]
                for s in plan.fresh:
                    retired[s.origin][a] += 1
                buf.give_back(plan)
            trained.append(ages)
            version += 1
            steps_done += 1
            if version % interval == 0:
                engine_version = version  # SyncWeights: held partial rollouts keep their birth version
            for r, budget in enumerate(budgets):  # Progress, after SyncWeights
                budget.update(steps_done, [retired[r][a] for a in range(num_shards)])
            continue
        assert in_flight, f"deadlock at version {version}: nothing in flight and a shard cannot serve a batch"
        # one group finishes: any of those in flight, the oldest less likely (a long tail)
        r, shard, birth, gid = in_flight.pop(rng.randrange(len(in_flight)) if rng.random() < 0.8 else 0)
        buffers[shard].add(
            [
                BufferedSample(
                    uid=f"{gid}/{k}", draw=gid, group_id=str(gid), prompt_ids=[1], output_ids=[2], logprobs=[0.0],
                    versions=[birth], reward=0.0, origin=r,
                )
                for k in range(group)
            ]
        )
        # the window is never exceeded: started minus retired, per shard
        for budget in budgets:
            for a in range(num_shards):
                assert budget.outstanding(a) <= (budget.window_share[a] if budget.window_share else 10**9)
    return trained


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_rollout=st.sampled_from([1, 2, 3]), num_shards=st.sampled_from([1, 2, 4]))
def test_one_step_off_trains_exactly_the_previous_policys_batch(seed, num_rollout, num_shards):
    trained = simulate("one_step_off", random.Random(seed), prompts=4, num_rollout=num_rollout, num_shards=num_shards)
    assert trained[0] == [0] * 8
    assert all(ages == [1] * 8 for ages in trained[1:])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    delta_interval=st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 2), (4, 2)]),
    num_rollout=st.sampled_from([1, 2]),
    num_shards=st.sampled_from([1, 2]),
)
def test_async_never_deadlocks_and_never_exceeds_delta(seed, delta_interval, num_rollout, num_shards):
    delta, interval = delta_interval
    trained = simulate("async", random.Random(seed), delta=delta, interval=interval, num_rollout=num_rollout, num_shards=num_shards)
    assert max(age for ages in trained for age in ages) <= delta
    assert all(len(ages) == 8 for ages in trained)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_rollout=st.sampled_from([1, 2]), num_shards=st.sampled_from([1, 2]))
def test_reflow_per_step_rule_never_deadlocks(seed, num_rollout, num_shards):
    trained = simulate(
        "reflow", random.Random(seed), delta=2, interval=2, sigma=0.5, num_rollout=num_rollout, num_shards=num_shards
    )
    assert max(age for ages in trained for age in ages) <= 2
    assert all(len(ages) >= 4 for ages in trained)  # at least b(1 - sigma) fresh samples per step
