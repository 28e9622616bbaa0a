"""The dispatch rule: shares, the window and per-step limits, and a protocol simulation of every decoupled mode
in which the real DispatchBudget and ReplayBuffer meet arbitrary finish orders (long tails included)."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.config import ConfigManager
from reflow.modes.settings import resolve_settings
from reflow.replay import AcceptAll, BufferedSample, RandomSampler, ReplayBuffer
from reflow.scheduler import DispatchBudget, DispatchRule, share_groups
from reflow.scheduler.concurrency import WorkerLoad
from reflow.scheduler.dispatch import GroupDispatcher, WorkerReport


@pytest.mark.parametrize("total,num_rollout,num_shards", [(8, 1, 1), (8, 2, 2), (3, 3, 2), (7, 3, 2), (16, 4, 4), (5, 2, 3)])
def test_shares_are_balanced_over_shards_and_rollout_ranks(total, num_rollout, num_shards):
    shares = share_groups(total, num_rollout, num_shards)
    per_shard = [sum(row[a] for row in shares) for a in range(num_shards)]
    per_rollout = [sum(row) for row in shares]
    assert sum(per_shard) == total
    assert max(per_shard) - min(per_shard) <= 1 and max(per_rollout) - min(per_rollout) <= 1
    if total >= num_rollout * num_shards:  # enough groups: every rollout rank feeds every shard
        assert all(n > 0 for row in shares for n in row), shares


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


def simulate(
    mode, rng, *, prompts=4, group=2, num_rollout=1, num_shards=1, delta=1, interval=1, steps=12, sigma=0.0,
    start=0, in_order=False, extra_ahead=0, dealt=False,
):
    """Rollout ranks with a real DispatchBudget, trainer shards with a real ReplayBuffer, each mode's settings
    from ``resolve_settings``, the protocol's order (SyncWeights, then Progress after every step), and groups
    that finish in a random order, some much later (a long tail), or in the order they started. ``start``:
    the run resumes at that step and version. ``dealt``: a ``GroupDispatcher`` deals the room by made-up KV
    loads (random each time, so groups go to the workers unevenly) instead of fixed shares. Returns, per step, the staleness of every fresh sample trained,
    and how many samples were evicted unused."""
    cfg = ConfigManager().parse_args(
        [
            f"--training.mode={mode}", f"--training.prompts_per_step={prompts}", f"--training.group_size={group}",
            f"--replay.delta={delta}", f"--weight_sync.interval={interval}", f"--replay.sigma={sigma}",
        ]
    )
    settings = resolve_settings(cfg)
    if extra_ahead:  # a window larger than the mode's: for showing that the mode's is the largest safe one
        settings = dataclasses.replace(
            settings, dispatch=DispatchRule(window=settings.dispatch.window + extra_ahead * prompts * group)
        )
    delta, interval = settings.delta, settings.interval
    budgets = [
        DispatchBudget(settings.dispatch, r, num_rollout, num_shards, group, start_step=start, dealt=dealt)
        for r in range(num_rollout)
    ]
    dispatcher = GroupDispatcher(settings.dispatch, num_rollout, num_shards, group, rho=1.0, start_step=start) if dealt else None

    def progress():
        if dispatcher is not None:
            for r, budget in enumerate(budgets):
                load = WorkerLoad(rng.uniform(0, 2000), 1000, sum(budget.started) - sum(retired[r]), cap=64)
                dispatcher.report(r, WorkerReport(load, rng.uniform(10, 200), sum(budget.started)))
            granted = dispatcher.deal(steps_done, retired)
        for r, budget in enumerate(budgets):
            budget.update(steps_done, [retired[r][a] for a in range(num_shards)])
            if dispatcher is not None:
                budget.grant(granted[r])
    buffers = [
        ReplayBuffer(settings.sigma, delta, RandomSampler(), AcceptAll(), seed=a, min_staleness=settings.min_staleness)
        for a in range(num_shards)
    ]
    for buf in buffers:
        buf.start_version = start
    retired = [[0] * num_shards for _ in range(num_rollout)]
    started = [[0] * num_shards for _ in range(num_rollout)]
    in_flight: list[tuple[int, int, int, int]] = []  # (rollout, shard, birth version, group id), in start order
    version = engine_version = steps_done = start
    made = evicted = 0
    per_shard = prompts * group // num_shards
    trained: list[list[int]] = []
    progress()
    while steps_done < start + steps:
        # rollout ranks admit everything their budget allows, on the engine's current weights
        for r, budget in enumerate(budgets):
            while (shard := budget.next_shard()) is not None:
                budget.record_start(shard)
                started[r][shard] += group
                in_flight.append((r, shard, engine_version, made))
                made += 1
        # the window bounds what is started and not yet retired, per (rollout rank, shard) pair
        if settings.dispatch.window:  # per pair with fixed shares; per shard when dealt
            for a in range(num_shards):
                if dealt:
                    assert sum(started[r][a] - retired[r][a] for r in range(num_rollout)) <= dispatcher.window_share[a]
                else:
                    assert all(started[r][a] - retired[r][a] <= budgets[r].window_share[a] for r in range(num_rollout))
        if settings.dispatch.per_step:  # B_max per trainer step, per shard
            for a in range(num_shards):
                share = share_groups(settings.dispatch.per_step // group, 1, num_shards)[0][a] * group
                assert sum(started[r][a] for r in range(num_rollout)) <= share * (steps_done - start + 1)
        # trainer shards: evict what went stale (retiring unused samples), then step if all can serve
        for a, buf in enumerate(buffers):
            for s in buf.evict_stale(version):
                if s.use_count == 0:
                    retired[s.origin][a] += 1
                    evicted += 1
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
            progress()  # after SyncWeights
            continue
        assert in_flight, f"deadlock at version {version}: nothing in flight and a shard cannot serve a batch"
        # one group finishes: the oldest (in order), or any of those in flight, the oldest less likely (a long tail)
        r, shard, birth, gid = in_flight.pop(0 if in_order or rng.random() >= 0.8 else rng.randrange(len(in_flight)))
        buffers[shard].add(
            [
                BufferedSample(
                    uid=f"{gid}/{k}", draw=gid, group_id=str(gid), prompt_ids=[1], output_ids=[2], logprobs=[0.0],
                    versions=[birth], reward=0.0, origin=r,
                )
                for k in range(group)
            ]
        )
    return trained, evicted


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_rollout=st.sampled_from([1, 2, 3]),
    num_shards=st.sampled_from([1, 2, 4]),
    start=st.sampled_from([0, 7]),
)
def test_one_step_off_trains_exactly_the_previous_policys_batch(seed, num_rollout, num_shards, start):
    """Also after a resume at step/version 7: the first step trains the resumed version's samples."""
    trained, evicted = simulate(
        "one_step_off", random.Random(seed), prompts=4, num_rollout=num_rollout, num_shards=num_shards, start=start
    )
    assert trained[0] == [0] * 8
    assert all(ages == [1] * 8 for ages in trained[1:])
    assert evicted == 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    delta_interval=st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 2), (4, 2)]),
    num_rollout=st.sampled_from([1, 2]),
    num_shards=st.sampled_from([1, 2]),
    start=st.sampled_from([0, 5]),
    dealt=st.booleans(),
)
def test_async_never_deadlocks(seed, delta_interval, num_rollout, num_shards, start, dealt):
    delta, interval = delta_interval
    trained, _ = simulate(
        "async", random.Random(seed), delta=delta, interval=interval, num_rollout=num_rollout, num_shards=num_shards,
        start=start, dealt=dealt,
    )
    assert len(trained) == 12 and all(len(ages) == 8 for ages in trained)


@pytest.mark.parametrize("delta,interval", [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (5, 3)])
def test_async_steps_ahead_wastes_nothing_when_samples_finish_in_order(delta, interval):
    """steps_ahead = delta - k + 1 is the largest look-ahead at which, finishing in start order, no sample is
    evicted unused: generation runs as far ahead as delta allows and no further."""
    trained, evicted = simulate("async", random.Random(0), delta=delta, interval=interval, in_order=True, steps=20)
    assert evicted == 0
    assert max(age for ages in trained for age in ages) == delta  # it does use the whole bound
    _, evicted = simulate("async", random.Random(0), delta=delta, interval=interval, in_order=True, steps=20, extra_ahead=1)
    assert evicted > 0  # one batch further ahead generates samples in vain


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6), num_rollout=st.sampled_from([1, 2, 3]), num_shards=st.sampled_from([1, 2]),
    dealt=st.booleans(),
)
def test_reflow_per_step_rule_never_deadlocks(seed, num_rollout, num_shards, dealt):
    trained, _ = simulate(
        "reflow", random.Random(seed), delta=2, interval=2, sigma=0.5, num_rollout=num_rollout, num_shards=num_shards,
        dealt=dealt,
    )
    assert len(trained) == 12 and all(len(ages) >= 4 for ages in trained)  # >= b(1 - sigma) fresh per step


def test_forced_schedule_is_a_placement_controller():
    from reflow.scheduler import ForcedSchedule, PlacementController

    schedule = ForcedSchedule([(4, 1), (8, 2)])
    assert isinstance(schedule, PlacementController)
    assert [schedule.decide(step, 2 if step <= 4 else 1, []).target for step in (2, 4, 6, 8)] == [None, 1, None, 2]
    assert schedule.decide(4, 1, []).target is None  # already there


# ---------------------------------------------------------------- the global dispatcher


def report(predicted, budget=1000, in_flight=4, cap=64, estimate=100, started=0):
    return WorkerReport(WorkerLoad(predicted, budget, in_flight, cap), estimate, started)


def test_dispatcher_sends_each_group_to_the_worker_with_the_most_kv_headroom():
    dispatcher = GroupDispatcher(DispatchRule(per_step=8), num_rollout=2, num_shards=1, group_size=2, rho=0.9)
    dispatcher.report(0, report(predicted=600))  # 0.6 of its budget
    dispatcher.report(1, report(predicted=100))  # 0.1
    # B_max = 4 groups; each goes to the smaller projected fraction (predicted + pending groups' estimates + one):
    # w1 0.2, w1 0.3, w1 0.4, w1 0.5 < w0 0.7: all four to worker 1
    assert dispatcher.deal(0, [[0], [0]]) == [[0], [8]]
    # worker 1 started its grants and now carries them: 0.5 of its budget. Step 1's four groups: w1 0.6 < w0 0.7
    # -> w1; tie at 0.7, fewer pending (w0 0) -> w0; w1 0.7 < w0 0.8 -> w1; tie at 0.8, w0 has fewer pending -> w0
    dispatcher.report(1, report(predicted=500, started=8))
    assert dispatcher.deal(1, [[0], [0]]) == [[4], [12]]


def test_dispatcher_respects_rho_and_the_cap_and_never_withholds_room():
    dispatcher = GroupDispatcher(DispatchRule(per_step=4), num_rollout=2, num_shards=1, group_size=2, rho=0.5)
    dispatcher.report(0, report(predicted=100, in_flight=62, cap=64))  # room for exactly one more group of 2
    dispatcher.report(1, report(predicted=350))  # 0.45 with one group: within rho 0.5, not with two
    # group 1: w0 0.2 fits (62 + 2 <= 64) -> w0; group 2: w0 would exceed its cap, w1 0.45 fits -> w1
    assert dispatcher.deal(0, [[0], [0]]) == [[2], [2]]
    # step 1's two groups: nobody fits any more (w0's cap; w1 at (350 + 2 x 100) / 1000 = 0.55 > rho), yet the
    # room still goes out, to the smaller fraction: w0 at 0.3, then 0.4, both below w1's 0.55
    assert dispatcher.deal(1, [[0], [0]]) == [[6], [2]]


def test_dispatcher_shares_out_evenly_before_any_report_and_keeps_shard_totals():
    dispatcher = GroupDispatcher(DispatchRule(window=12), num_rollout=3, num_shards=2, group_size=2, rho=1.0)
    granted = dispatcher.deal(0, [[0, 0]] * 3)
    assert [sum(row) for row in granted] == [4, 4, 4]  # nobody reported: the groups go round
    assert [sum(row[a] for row in granted) for a in range(2)] == [6, 6]  # the window's per-shard shares
    granted = dispatcher.deal(0, [[2, 0], [0, 0], [0, 0]])  # two samples of shard 0 retired: one more group
    assert [sum(row[a] for row in granted) for a in range(2)] == [8, 6]


def test_dealt_budget_starts_only_what_was_granted():
    budget = DispatchBudget(DispatchRule(per_step=8), 0, 2, 2, group_size=2, dealt=True)
    assert budget.next_shard() is None  # nothing granted yet, whatever the fixed share would be
    budget.grant([4, 0])
    assert budget.next_shard() == 0
    budget.record_start(0)
    budget.record_start(0)
    assert budget.next_shard() is None
    budget.grant([2, 2])  # an older word: grants are cumulative
    assert budget.room(0) == 0 and budget.room(1) == 2
    with pytest.raises(RuntimeError, match="dealt"):
        DispatchBudget(DispatchRule(per_step=8), 0, 2, 2, group_size=2).grant([2, 2])
