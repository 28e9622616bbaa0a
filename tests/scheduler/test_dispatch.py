"""The dispatch rule: shares, the window and per-step limits, and a protocol simulation of every decoupled mode
in which the real DispatchBudget and ReplayBuffer meet arbitrary finish orders (long tails included)."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.config import ConfigManager
from reflow.config.mode_settings import resolve_settings
from reflow.replay import AcceptAll, RandomSampler, ReplayBuffer
from reflow.scheduler import DispatchBudget, DispatchRule, share_groups
from reflow.scheduler.concurrency import WorkerLoad
from reflow.scheduler.dispatch import GroupDispatcher, WorkerReport
from reflow.scheduler.routing import Move, ShardCounts, ShardRouter, deal_groups, plan_moves
from reflow.types import Sample


@pytest.mark.parametrize("total,num_rollout", [(8, 1), (8, 2), (3, 3), (7, 3), (16, 4), (5, 2)])
def test_shares_are_balanced_and_grow_with_the_total(total, num_rollout):
    shares = share_groups(total, num_rollout)
    assert sum(shares) == total and max(shares) - min(shares) <= 1
    assert all(a >= b for a, b in zip(share_groups(total + 1, num_rollout), shares))


def test_window_grants_exactly_what_was_retired():
    budget = DispatchBudget(DispatchRule(window=8), 0, 1, group_size=2)
    starts = 0
    while budget.can_start():
        budget.record_start()
        starts += 1
    assert starts == 4 and budget.outstanding == 8
    budget.update(steps_done=5, retired=2)  # steps do not matter to a window
    assert budget.room() == 2
    budget.record_start()
    assert not budget.can_start()
    budget.update(steps_done=4, retired=1)  # an older word changes nothing: counts are cumulative
    assert budget.room() == 0
    with pytest.raises(RuntimeError, match="no room"):
        budget.record_start()


def test_per_step_credit_expires_at_the_next_step():
    """B_max = 8 over two workers: worker 1 may start 4 samples between two trainer steps; credit it did not use
    is gone at the next step, and a word reporting two steps at once opens one period, not two."""
    budget = DispatchBudget(DispatchRule(window=100, per_step=8), 1, 2, group_size=2, start_step=10)  # resumed at 10
    assert budget.room() == 4  # half of B_max before the first step
    budget.record_start()
    budget.update(steps_done=10, retired=0)  # the same step: the period goes on
    assert budget.room() == 2
    budget.update(steps_done=11, retired=0)  # a new step: 2 unused samples of credit expire
    assert budget.room() == 4 and budget.started_this_step == 0
    budget.update(steps_done=13, retired=0)  # two steps in one word
    assert budget.room() == 4


def test_both_limits_take_the_smaller():
    budget = DispatchBudget(DispatchRule(window=4, per_step=2), 0, 1, group_size=2)
    assert budget.room() == 2
    budget.record_start()
    budget.update(steps_done=5, retired=0)
    assert budget.room() == 2  # the window has 2 left, the new step's B_max 2
    budget.record_start()
    budget.update(steps_done=6, retired=0)
    assert budget.room() == 0  # B_max has room, the window none


def test_rule_needs_a_window():
    with pytest.raises(ValueError, match="window > 0"):
        DispatchRule(window=0)
    with pytest.raises(ValueError, match=">= 0"):
        DispatchRule(window=4, per_step=-1)


@settings(max_examples=80, deadline=None)
@given(
    num_rollout=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]), ahead=st.sampled_from([1, 2, 3]),
    b_max_batches=st.sampled_from([0, 1, 2]), seed=st.integers(0, 10**6),
)
def test_budgets_keep_the_window_and_b_max_with_no_carried_credit(num_rollout, group, ahead, b_max_batches, seed):
    """Random retirements and steps: over the workers, started - retired stays within the window, and within
    each step period every worker starts at most its share of B_max, whatever it left unused before."""
    rng = random.Random(seed)
    batch = 2 * group * num_rollout
    rule = DispatchRule(window=(ahead + 1) * batch, per_step=b_max_batches * batch)
    budgets = [DispatchBudget(rule, r, num_rollout, group) for r in range(num_rollout)]
    retired, steps = [0] * num_rollout, 0
    for _ in range(60):
        action = rng.random()
        if action < 0.5:  # a worker starts what it may (or part of it: its gate may hold groups back)
            worker = rng.randrange(num_rollout)
            while budgets[worker].can_start() and rng.random() < 0.8:
                budgets[worker].record_start()
        elif action < 0.8:  # the trainer retires some outstanding samples
            worker = rng.randrange(num_rollout)
            retired[worker] += rng.randint(0, budgets[worker].started - retired[worker])
        else:
            steps += 1
        for r, budget in enumerate(budgets):
            budget.update(steps, retired[r])
            assert budget.outstanding <= budget.window_share
            if rule.per_step:
                assert budget.started_this_step <= budget.step_share
        assert sum(b.outstanding for b in budgets) <= rule.window


@settings(max_examples=60, deadline=None)
@given(num_rollout=st.sampled_from([1, 2, 3]), ahead=st.sampled_from([1, 2]), b_max_batches=st.sampled_from([0, 1, 2]),
       seed=st.integers(0, 10**6))
def test_a_step_that_took_a_batch_opens_a_batch_of_look_ahead(num_rollout, ahead, b_max_batches, seed):
    """The dispatcher deals every sample the rule allows; once a step has retired b fresh samples it deals at least
    b more (the window freed b, and B_max >= b starts a new period), and never more than the window."""
    rng = random.Random(seed)
    group, batch = 2, 8
    rule = DispatchRule(window=(ahead + 1) * batch, per_step=b_max_batches * batch)
    dispatcher = GroupDispatcher(rule, num_rollout, group, rho=1.0)
    retired = [0] * num_rollout
    granted = dispatcher.deal(0, retired)
    for step in range(1, 8):
        # the step trains b of the granted samples, from any workers
        outstanding = [g - r for g, r in zip(granted, retired)]
        for _ in range(batch):
            worker = rng.choice([w for w in range(num_rollout) if outstanding[w] > 0])
            outstanding[worker] -= 1
            retired[worker] += 1
        before = sum(granted)
        granted = dispatcher.deal(step, retired)
        assert sum(granted) - before >= batch
        assert sum(granted) - sum(retired) <= rule.window


# ---------------------------------------------------------------- protocol simulation


def simulate(
    mode, rng, *, prompts=4, group=2, num_rollout=1, num_shards=1, delta=1, interval=1, steps=12, sigma=0.0,
    start=0, in_order=False, extra_ahead=0, dealt=False, anchor="finish",
):
    """Rollout workers with a real DispatchBudget and ShardRouter, trainer shards with a real ReplayBuffer and
    ``plan_moves``, each mode's settings from ``resolve_settings``, the protocol's order (SyncWeights, then
    Progress after every step: the routers see the shards' counts only then, a moment old), and groups that
    finish in a random order, some much later (a long tail), or in the order they started. ``start``: the run
    resumes at that step and version. ``dealt``: a ``GroupDispatcher`` deals the room by made-up KV loads
    (random each time, so groups go to the workers unevenly) instead of fixed shares. Returns, per step, the
    staleness of every fresh sample trained, how many samples were evicted unused, and how many moved."""
    cfg = ConfigManager().parse_args(
        [
            f"--training.mode={mode}", f"--training.prompts_per_step={prompts}", f"--training.group_size={group}",
            f"--replay.delta={delta}", f"--weight_sync.interval={interval}", f"--replay.sigma={sigma}",
            f"--replay.staleness_from={anchor}",
        ]
    )
    settings = resolve_settings(cfg)
    if extra_ahead:  # a window larger than the mode's: for showing that the mode's is the largest safe one
        settings = dataclasses.replace(
            settings, dispatch=DispatchRule(window=settings.dispatch.window + extra_ahead * prompts * group)
        )
    delta, interval, rule = settings.delta, settings.interval, settings.dispatch
    budgets = [DispatchBudget(rule, r, num_rollout, group, start_step=start, dealt=dealt) for r in range(num_rollout)]
    routers = [ShardRouter(num_shards, first=r) for r in range(num_rollout)]
    dispatcher = GroupDispatcher(rule, num_rollout, group, rho=1.0, start_step=start) if dealt else None
    buffers = [
        ReplayBuffer(settings.sigma, delta, RandomSampler(), AcceptAll(), seed=a, min_staleness=settings.min_staleness,
                     anchor=settings.anchor)
        for a in range(num_shards)
    ]
    for buf in buffers:
        buf.start_version = start
    retired = [0] * num_rollout
    in_flight: list[tuple[int, int, int]] = []  # (rollout worker, birth version, group id), in start order
    version = engine_version = steps_done = start
    made = evicted = moved = 0
    per_shard = prompts * group // num_shards
    trained: list[list[int]] = []

    def progress():
        if dispatcher is not None:
            for r, budget in enumerate(budgets):
                load = WorkerLoad(rng.uniform(0, 2000), 1000, budget.started - retired[r], cap=64)
                dispatcher.report(r, WorkerReport(load, rng.uniform(10, 200), budget.started))
            granted = dispatcher.deal(steps_done, retired)
        for r, budget in enumerate(budgets):
            budget.update(steps_done, retired[r])
            if dispatcher is not None:
                budget.grant(granted[r])
            routers[r].update([buf.num_unused for buf in buffers])

    progress()
    while steps_done < start + steps:
        # rollout workers admit everything their budget allows, on the engine's current weights
        for r, budget in enumerate(budgets):
            while budget.can_start():
                budget.record_start()
                in_flight.append((r, engine_version, made))
                made += 1
            if not dealt:  # each worker's share of both limits
                assert budget.outstanding <= budget.window_share
                if rule.per_step:
                    assert budget.started_this_step <= budget.step_share
        assert sum(budget.started - retired[r] for r, budget in enumerate(budgets)) <= rule.window
        # trainer shards: evict what went stale (retiring unused samples), even out, then step if all can serve
        for buf in buffers:
            for s in buf.evict_stale(version):
                if s.use_count == 0:
                    retired[s.origin] += 1
                    evicted += 1
        while moves := plan_moves([
            ShardCounts(buf.num_eligible(version), buf.need(per_shard), buf.num_urgent(version), per_shard) for buf in buffers
        ]):
            for move in moves:
                buffers[move.receiver].add(buffers[move.donor].take_eligible(move.first, move.count, version))
                moved += move.count
        if all(buf.can_serve(per_shard, version) for buf in buffers):
            ages = []
            for buf in buffers:
                plan = buf.plan_batch(per_shard, version)
                assert plan.size == per_shard
                ages += [buf.staleness(s, version) for s in plan.fresh]
                for s in plan.fresh:
                    retired[s.origin] += 1
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
        r, birth, gid = in_flight.pop(0 if in_order or rng.random() >= 0.8 else rng.randrange(len(in_flight)))
        samples = [
            Sample(
                uid=f"{gid}/{k}", draw=gid, group_id=str(gid), prompt_ids=[1], output_ids=[2], logprobs=[0.0],
                versions=[birth], reward=0.0, origin=r, finish_version=engine_version,
            )
            for k in range(group)
        ]
        buf = buffers[routers[r].choose(group)]  # bound to a shard on arrival
        for s in samples:
            if buf.is_stale(s, version):
                retired[r] += 1
                evicted += 1
            else:
                buf.add([s])
    return trained, evicted, moved


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_rollout=st.sampled_from([1, 2, 3]),
    num_shards=st.sampled_from([1, 2, 4]),
    start=st.sampled_from([0, 7]),
)
def test_one_step_off_trains_exactly_the_previous_policys_batch(seed, num_rollout, num_shards, start):
    """Also after a resume at step/version 7: the first step trains the resumed version's samples."""
    trained, evicted, _ = simulate(
        "one_step_off", random.Random(seed), prompts=4, num_rollout=num_rollout, num_shards=num_shards, start=start
    )
    assert trained[0] == [0] * 8
    assert all(ages == [1] * 8 for ages in trained[1:])
    assert evicted == 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    mode=st.sampled_from(["async", "reflow"]),
    delta_interval=st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 2), (4, 2)]),
    num_rollout=st.sampled_from([1, 2, 3]),
    num_shards=st.sampled_from([1, 2]),
    start=st.sampled_from([0, 5]),
    dealt=st.booleans(),
)
def test_window_modes_never_deadlock_and_waste_nothing_from_the_finish(
    seed, mode, delta_interval, num_rollout, num_shards, start, dealt
):
    """Long-tail finish orders, several workers and shards, fixed or dealt: every step trains exactly b, none
    staler than delta (from the finish), and no sample is ever evicted unused."""
    delta, interval = delta_interval
    trained, evicted, _ = simulate(
        mode, random.Random(seed), delta=delta, interval=interval, num_rollout=num_rollout, num_shards=num_shards,
        start=start, dealt=dealt, sigma=0.5 if mode == "reflow" else 0.0,
    )
    assert len(trained) == 12
    assert all(max(ages, default=0) <= delta for ages in trained)
    assert all(len(ages) >= (8 if mode == "async" else 4) for ages in trained)  # >= b(1 - sigma) fresh per step
    assert evicted == 0


@pytest.mark.parametrize("delta,interval", [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (5, 3)])
def test_async_steps_ahead_wastes_nothing_when_samples_finish_in_order(delta, interval):
    """Counted from the start: steps_ahead = delta - k + 1 is the largest look-ahead at which, finishing in start
    order, no sample is evicted unused: generation runs as far ahead as delta allows and no further."""
    trained, evicted, _ = simulate(
        "async", random.Random(0), delta=delta, interval=interval, in_order=True, steps=20, anchor="start"
    )
    assert evicted == 0
    assert max(age for ages in trained for age in ages) == delta  # it does use the whole bound
    _, evicted, _ = simulate(
        "async", random.Random(0), delta=delta, interval=interval, in_order=True, steps=20, extra_ahead=1, anchor="start"
    )
    assert evicted > 0  # one batch further ahead generates samples in vain


@pytest.mark.parametrize("mode", ["async", "reflow"])
def test_counted_from_the_start_a_long_tail_is_evicted(mode):
    """The old anchor, kept selectable for comparison: over the same 20 long-tail histories, samples overtaken
    by later ones go stale when counted from the start, and none does when counted from the finish."""
    sigma = 0.5 if mode == "reflow" else 0.0
    from_start = [simulate(mode, random.Random(seed), delta=2, interval=2, num_rollout=2, steps=30, anchor="start",
                           sigma=sigma)[1] for seed in range(20)]
    from_finish = [simulate(mode, random.Random(seed), delta=2, interval=2, num_rollout=2, steps=30, sigma=sigma)[1]
                   for seed in range(20)]
    assert sum(from_start) > 0 and sum(from_finish) == 0, (from_start, from_finish)


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
    dispatcher = GroupDispatcher(DispatchRule(window=100, per_step=8), num_rollout=2, group_size=2, rho=0.9)
    dispatcher.report(0, report(predicted=600))  # 0.6 of its budget
    dispatcher.report(1, report(predicted=100))  # 0.1
    # B_max = 4 groups; each goes to the smaller projected fraction (predicted + pending groups' estimates + one):
    # w1 0.2, w1 0.3, w1 0.4, w1 0.5 < w0 0.7: all four to worker 1
    assert dispatcher.deal(0, [0, 0]) == [0, 8]
    # worker 1 started its grants and now carries them: 0.5 of its budget. Step 1's four groups: w1 0.6 < w0 0.7
    # -> w1; tie at 0.7, fewer pending (w0 0) -> w0; w1 0.7 < w0 0.8 -> w1; tie at 0.8, w0 has fewer pending -> w0
    dispatcher.report(1, report(predicted=500, started=8))
    assert dispatcher.deal(1, [0, 0]) == [4, 12]


def test_dispatcher_respects_rho_and_the_cap_and_never_withholds_room():
    dispatcher = GroupDispatcher(DispatchRule(window=100, per_step=4), num_rollout=2, group_size=2, rho=0.5)
    dispatcher.report(0, report(predicted=100, in_flight=62, cap=64))  # room for exactly one more group of 2
    dispatcher.report(1, report(predicted=350))  # 0.45 with one group: within rho 0.5, not with two
    # group 1: w0 0.2 fits (62 + 2 <= 64) -> w0; group 2: w0 would exceed its cap, w1 0.45 fits -> w1
    assert dispatcher.deal(0, [0, 0]) == [2, 2]
    # step 1's two groups: nobody fits any more (w0's cap; w1 at (350 + 2 x 100) / 1000 = 0.55 > rho), yet the
    # room still goes out, to the smaller fraction: w0 at 0.3, then 0.4, both below w1's 0.55
    assert dispatcher.deal(1, [0, 0]) == [6, 2]


def test_dispatcher_shares_out_evenly_before_any_report_and_follows_the_window():
    dispatcher = GroupDispatcher(DispatchRule(window=12), num_rollout=3, group_size=2, rho=1.0)
    assert dispatcher.deal(0, [0, 0, 0]) == [4, 4, 4]  # nobody reported: the groups go round
    assert sum(dispatcher.deal(0, [2, 0, 0])) == 14  # two samples retired: one more group
    assert sum(dispatcher.deal(0, [2, 0, 0])) == 14  # the same word again: nothing more


def test_dispatcher_room_not_dealt_by_the_next_step_expires():
    dispatcher = GroupDispatcher(DispatchRule(window=8, per_step=8), num_rollout=1, group_size=2, rho=1.0)
    assert dispatcher.deal(0, [0]) == [8]
    assert dispatcher.deal(1, [2]) == [10]  # the window frees 2; B_max would allow 8 this step
    assert dispatcher.deal(2, [8]) == [16]  # step 2: 6 more from the window; step 1's unused 6 are gone


def test_dealt_budget_starts_only_what_was_granted():
    budget = DispatchBudget(DispatchRule(window=100, per_step=8), 0, 2, group_size=2, dealt=True)
    assert not budget.can_start()  # nothing granted yet, whatever the fixed share would be
    budget.grant(4)
    budget.record_start()
    budget.record_start()
    assert not budget.can_start()
    budget.grant(2)  # an older word: grants are cumulative
    assert budget.room() == 0
    with pytest.raises(RuntimeError, match="dealt"):
        DispatchBudget(DispatchRule(window=8), 0, 2, group_size=2).grant(2)


# ---------------------------------------------------------------- routing at arrival


def test_router_sends_each_group_to_the_shard_with_the_fewest_unused_samples():
    router = ShardRouter(3, first=1)
    router.update([4, 0, 0])
    assert [router.choose(2) for _ in range(4)] == [1, 2, 1, 2]  # ties from shard 1 on, then round robin
    assert router.choose(2) == 0  # 4 + 0 = 4 against 4 and 4: the tie goes round to shard 0
    router.update([4, 4, 4])  # the same counts the worker's sends made: its own count restarts
    assert router.sent_since == [0, 0, 0]
    with pytest.raises(ValueError, match="3"):
        router.update([1, 2])


def test_moves_spread_samples_at_their_last_version_once_no_shard_is_short():
    """Shard 0 holds 7 samples due now but trains 4 per step: its 3 after the first 4 go to the shards whose own
    batch has room for them (shard 1 has 1 urgent of 4, shard 2 has 4 of 4)."""
    counts = [ShardCounts(eligible=9, need=4, urgent=7, batch=4), ShardCounts(eligible=5, need=4, urgent=1, batch=4),
              ShardCounts(eligible=4, need=4, urgent=4, batch=4)]
    assert plan_moves(counts) == [Move(0, 1, 3, first=4)]
    counts[1] = ShardCounts(eligible=5, need=4, urgent=2, batch=4)
    assert plan_moves(counts) == [Move(0, 1, 2, first=4)]  # one more than the others can take: it will go stale
    short = [ShardCounts(eligible=9, need=4, urgent=7, batch=4), ShardCounts(eligible=1, need=4, urgent=0, batch=4)]
    assert plan_moves(short) == [Move(0, 1, 3)]  # a short shard is served first, from the latest deadlines


def test_moves_serve_short_shards_from_surplus_and_leave_donors_ready():
    counts = [ShardCounts(eligible=10, need=4), ShardCounts(eligible=1, need=4), ShardCounts(eligible=6, need=4),
              ShardCounts(eligible=0, need=2)]
    moves = plan_moves(counts)
    assert moves == [Move(0, 1, 3), Move(0, 3, 2)]
    assert plan_moves([ShardCounts(3, 4), ShardCounts(4, 4)]) == []  # nobody has anything to spare
    assert plan_moves([ShardCounts(2, 4), ShardCounts(6, 4)]) == [Move(1, 0, 2)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 10)), min_size=1, max_size=6))
def test_moves_make_every_shard_ready_when_the_total_suffices(pairs):
    counts = [ShardCounts(eligible=e, need=n) for e, n in pairs]
    after = [c.eligible for c in counts]
    for move in plan_moves(counts):
        assert move.count > 0
        after[move.donor] -= move.count
        after[move.receiver] += move.count
    for c, a in zip(counts, after):
        assert a >= min(c.eligible, c.need)  # a donor keeps what it needs
    if sum(c.eligible for c in counts) >= sum(c.need for c in counts):
        assert all(a >= c.need for c, a in zip(counts, after))


def test_a_placement_change_deals_held_groups_to_the_least_loaded_workers():
    """Old workers 0 and 2 stay (as new workers 1 and 0); old worker 1 leaves: each of its groups goes to the
    new worker holding the fewest sequences, ties to the lowest index; nothing is lost or dealt twice."""
    held = [[4, 4], [4, 2, 4], [4]]
    dealt = deal_groups(held, stays=[1, None, 0], num_new=2)
    assert dealt[1][:2] == [(0, 0), (0, 1)] and dealt[0][:1] == [(2, 0)]  # a staying worker keeps its own, first
    # loads start at 4 (new 0) and 8 (new 1): the 4 -> new 0 (8); the 2 -> new 0 (tied at 8: the lower index,
    # 10); the last 4 -> new 1 (12)
    assert dealt[0][1:] == [(1, 0), (1, 1)] and dealt[1][2:] == [(1, 2)]
    everything = sorted(pair for worker in dealt for pair in worker)
    assert everything == sorted((w, k) for w, groups in enumerate(held) for k in range(len(groups)))
    with pytest.raises(ValueError, match="no rollout worker"):
        deal_groups([[4]], stays=[None], num_new=0)
