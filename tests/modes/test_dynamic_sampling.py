"""DAPO's dynamic sampling in the decoupled modes' roles (reward.dynamic_sampling): a group whose rewards are all
equal is retired on arrival as evicted "no_signal" and counted as filtered; filtered samples refund the per-step
credit (B_max) of ``DispatchBudget`` and ``GroupDispatcher``, never the window; so a step whose fresh share
needs more than B_max x (1 - filtered fraction) starts still fills (``docs/decoupled_protocol.md``). In process,
without torch.distributed."""

import dataclasses
import random
import threading
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.algorithms.shaping import MAX_EXTRA_BATCHES
from reflow.config import ConfigError, ConfigManager
from reflow.config.validate import validate
from reflow.modes import sync as sync_mode
from reflow.modes.base import StepTimer
from reflow.modes.leader import Leader
from reflow.modes.ledger import new_ledger
from reflow.modes.rollout_worker import apply_progress
from reflow.modes.sync import MAX_EXTRA_ROUNDS, SyncMode
from reflow.modes.trainer_shard import TrainerShard
from reflow.replay import AcceptAll, RandomSampler, ReplayBuffer
from reflow.scheduler import DispatchBudget, DispatchRule
from reflow.scheduler.dispatch import GroupDispatcher
from reflow.scheduler.routing import ShardRouter
from reflow.types import Sample, SampleStage, TrainerView

GROUP = 4


def group(draw: int, origin: int, version: int, signal: bool) -> list[Sample]:
    """A finished group: rewards 1, 0, 0, 0 (signal) or all 0 (none)."""
    return [
        Sample(uid=f"g{draw}/{k}", draw=draw, group_id=f"g{draw}", prompt_ids=[1], output_ids=[5] * (k + 1),
               logprobs=[-0.1] * (k + 1), versions=[version] * (k + 1), reward=float(signal and k == 0),
               origin=origin, finish_version=version, stage=SampleStage.SENT)
        for k in range(GROUP)
    ]


def shard(batch: int, num_rollout: int, dynamic_sampling: bool, sigma: float = 0.0, delta: int = 2) -> TrainerShard:
    buffer = ReplayBuffer(sigma, delta, RandomSampler(), AcceptAll(), seed=0, anchor="finish")
    buffer.start_version = 0
    return TrainerShard(buffer, 0, num_rollout, batch, new_ledger(), dynamic_sampling=dynamic_sampling)


class Sink:
    def __init__(self):
        self.sent: dict[int, list] = {}

    def send(self, dst, command):
        self.sent.setdefault(dst, []).append(command)


# ---- (a) the shard ---------------------------------------------------------------------------------------


def test_a_group_without_signal_is_retired_on_arrival_as_no_signal_and_counted_as_filtered():
    one = shard(8, num_rollout=2, dynamic_sampling=True)
    one.accept_group(group(0, origin=1, version=0, signal=False), version=0)
    one.accept_group(group(1, origin=0, version=0, signal=True), version=0)
    assert one.retired == [0, GROUP] and one.filtered == [0, GROUP]
    assert [s.group_id for s in one.buffer.unused] == ["g1"] * GROUP  # only the group with signal is buffered
    assert {one.ledger["eviction_causes"][u] for u in one.ledger["evicted_unused"]} == {"no_signal"}
    assert len(one.ledger["evicted_unused"]) == GROUP and len(one.ledger["received"]) == 2 * GROUP
    report = one.readiness(0)
    assert report.retired == (0, GROUP) and report.filtered == (0, GROUP) and report.unused == GROUP
    window = one.take_window()
    assert window.received == 2 * GROUP and window.evicted["no_signal"] == GROUP
    assert window.retired_lengths == []  # no staleness loss: survival by length leaves filtered samples out
    view = TrainerView.combine([report, report])  # two shards' reports add up
    assert view.retired == (0, 2 * GROUP) and view.filtered == (0, 2 * GROUP)
    one.restart_budgets(3)  # a new placement's budgets start afresh
    assert one.readiness(0).filtered == (0, 0, 0)


def test_without_dynamic_sampling_every_group_is_buffered():
    one = shard(8, num_rollout=2, dynamic_sampling=False)
    one.accept_group(group(0, origin=1, version=0, signal=False), version=0)
    one.accept_group(group(1, origin=0, version=0, signal=True), version=0)
    assert one.retired == [0, 0] and one.filtered == [0, 0] and len(one.buffer.unused) == 2 * GROUP
    assert one.readiness(0).filtered == (0, 0) and one.window.evicted["no_signal"] == 0


def test_a_filtered_group_counted_against_no_budget_refunds_nobody():
    one = shard(8, num_rollout=2, dynamic_sampling=True)
    one.accept_group(group(0, origin=-1, version=0, signal=False), version=0)  # restored or handed over
    assert one.retired == [0, 0] and one.filtered == [0, 0] and one.window.evicted["no_signal"] == GROUP


def test_the_leader_sends_each_worker_its_filtered_count():
    one = shard(8, num_rollout=2, dynamic_sampling=True)
    one.accept_group(group(0, origin=1, version=0, signal=False), version=0)
    sink = Sink()
    leader = Leader(sink, GROUP, controller=None)
    leader.enter([1, 2], dispatcher=None)
    leader.publish(0, TrainerView.combine([one.readiness(0)]))
    assert sink.sent[1][0].filtered == 0 and sink.sent[2][0].filtered == GROUP
    assert sink.sent[2][0].retired == GROUP


def test_one_step_off_rejects_dynamic_sampling():
    """one_step_off trains exactly the b samples born one version back: a dropped group's replacement starts on
    the next version and can never fill that batch (the mode would wait forever)."""
    with pytest.raises(ConfigError, match="reward.dynamic_sampling"):
        validate(ConfigManager().parse_args(["--training.mode=one_step_off", "--reward.dynamic_sampling=true"]))
    for mode in ("sync", "async", "reflow"):
        validate(ConfigManager().parse_args([f"--training.mode={mode}", "--reward.dynamic_sampling=true"]))


# ---- (b) the refund, exactly -----------------------------------------------------------------------------


def test_filtered_samples_refund_a_spent_step_credit_exactly_and_never_the_window():
    """One worker, group 2, window 12, B_max 8."""
    budget = DispatchBudget(DispatchRule(window=12, per_step=8), 0, 1, group_size=2)
    for _ in range(4):
        budget.record_start()
    assert budget.room() == 0 and budget.started_this_step == 8  # B_max spent (the window has 4 left)
    budget.update(steps_done=0, retired=4, filtered=4)  # two groups filtered on arrival
    assert budget.started_this_step == 4 and budget.room() == 4  # their 4 samples of credit come back, no more
    budget.update(steps_done=0, retired=4, filtered=4)  # the same word again: cumulative, nothing new
    assert budget.room() == 4
    budget.record_start()
    budget.record_start()
    assert budget.room() == 0 and budget.outstanding == 8
    # a step: 4 samples trained, 2 more filtered; those reported with the step refund the new period
    budget.update(steps_done=1, retired=10, filtered=6)
    assert budget.started_this_step == -2  # B_max would allow 8 + 2 = 10 ...
    assert budget.room() == 10  # ... and so does the window: 10 + 12 - 12
    while budget.can_start():
        budget.record_start()
    assert budget.outstanding == 12 and budget.room() == 0  # the window binds: started - retired <= 12
    budget.update(steps_done=1, retired=14, filtered=10)  # 4 more filtered: the window reopens by exactly 4
    assert budget.started_this_step == 4 and budget.room() == 4  # (and the period's credit has 8 - 4 left)


def test_a_dealing_dispatcher_counts_filtered_grants_back_exactly():
    """Two workers, group 2, window 12, B_max 8, dealt by the leader: each word (steps done, retired and filtered
    per worker) and the total it grants."""
    dispatcher = GroupDispatcher(DispatchRule(window=12, per_step=8), 2, 2, rho=1.0)
    words = [
        (0, [0, 0], [0, 0], 8),  # B_max before the first step
        (0, [2, 0], [2, 0], 10),  # a group filtered on arrival: its 2 samples of credit come back, no more
        (0, [2, 0], [2, 0], 10),  # the same word again: cumulative counts, nothing new
        (0, [4, 2], [4, 2], 14),  # 4 more filtered: 4 more
        (1, [8, 6], [4, 2], 22),  # step 1 trained 8 fresh: a new period of 8 (the window, 14 + 12 - 14, allows it)
        (2, [8, 6], [4, 2], 26),  # step 2 trained restored samples only (origin -1): B_max allows 8, the window 4
        (2, [10, 6], [6, 2], 28),  # 2 more filtered: the window reopens by exactly 2 and binds again
    ]
    for steps_done, retired, filtered, total in words:
        granted = dispatcher.deal(steps_done, retired, filtered)
        assert sum(granted) == total
        assert sum(granted) - sum(retired) <= 12  # R1: the refunds never stretch the window


@settings(max_examples=80, deadline=None)
@given(num_rollout=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]), seed=st.integers(0, 10**6))
def test_refunds_never_break_the_window_and_b_max_counts_net_starts(num_rollout, group, seed):
    """Random starts, retirements (some filtered) and steps: started - retired stays within each worker's window
    share, and each period's starts less its filtered samples stay within its B_max share."""
    rng = random.Random(seed)
    batch = 2 * group * num_rollout
    rule = DispatchRule(window=2 * batch, per_step=batch)
    budgets = [DispatchBudget(rule, r, num_rollout, group) for r in range(num_rollout)]
    retired, filtered, steps = [0] * num_rollout, [0] * num_rollout, 0
    for _ in range(80):
        action, worker = rng.random(), rng.randrange(num_rollout)
        if action < 0.5:
            while budgets[worker].can_start() and rng.random() < 0.8:
                budgets[worker].record_start()
        elif action < 0.85:  # some outstanding samples retire, a random part of them filtered
            count = rng.randint(0, budgets[worker].started - retired[worker])
            retired[worker] += count
            filtered[worker] += rng.randint(0, count)
        else:
            steps += 1
        for r, budget in enumerate(budgets):
            budget.update(steps, retired[r], filtered[r])
            assert budget.outstanding <= budget.window_share
            assert budget.started_this_step <= budget.step_share


# ---- (c) no deadlock: a simulated loop ---------------------------------------------------------------------


def run_loop(ticks: int, refund: bool, dealt: bool) -> tuple[int, list[int]]:
    """Two rollout workers, one trainer shard, b = 8 fresh samples a step (sigma 0), B_max = b, window 2b
    (reflow's with delta 1, k 1); every other group started has no signal. Per tick: every worker starts what its
    budget allows, its groups finish at once and reach the shard, the trainer exchanges readiness and the leader
    publishes Progress (and deals); a ready shard trains a batch. ``refund`` False: the trainer reports no
    filtered samples (the per-step credit counts them as if they had arrived). Returns (steps, fresh per step)."""
    batch, num_rollout = 2 * GROUP, 2
    rule = DispatchRule(window=2 * batch, per_step=batch)
    trainer = shard(batch, num_rollout, dynamic_sampling=True, delta=1)
    sink = Sink()
    leader = Leader(sink, GROUP, controller=None)
    ranks = [1, 2]
    leader.enter(ranks, GroupDispatcher(rule, num_rollout, GROUP, rho=1.0) if dealt else None)
    budgets = [DispatchBudget(rule, r, num_rollout, GROUP, dealt=dealt) for r in range(num_rollout)]
    routers = [ShardRouter(1, first=r) for r in range(num_rollout)]
    version = steps = started = 0
    fresh_per_step: list[int] = []

    def exchange() -> TrainerView:
        view = TrainerView.combine([trainer.readiness(version)])
        if not refund:
            view = dataclasses.replace(view, filtered=(0,) * num_rollout)
        leader.publish(steps, view)
        for worker, rank in enumerate(ranks):
            for word in sink.sent.pop(rank, []):
                apply_progress(word, budgets[worker], routers[worker])
        return view

    exchange()
    for _ in range(ticks):
        for worker, budget in enumerate(budgets):
            while budget.can_start():
                budget.record_start()
                trainer.accept_group(group(started, worker, version, signal=started % 2 == 1), version)
                started += 1
        assert sum(b.started for b in budgets) - sum(trainer.retired) <= rule.window  # R1 holds throughout
        if exchange().all_ready:
            plan = trainer.plan(version)
            trainer.retire_trained(plan)
            fresh_per_step.append(len(plan.fresh))
            steps += 1
            version += 1
            exchange()
    return steps, fresh_per_step


@pytest.mark.parametrize("dealt", [False, True], ids=["fixed", "dealt"])
def test_half_the_groups_filtered_and_b_max_equal_to_the_batch_still_fills_every_step(dealt):
    steps, fresh = run_loop(40, refund=True, dealt=dealt)
    assert steps >= 10 and set(fresh) == {2 * GROUP}  # every step a full fresh batch
    stalled, _ = run_loop(40, refund=False, dealt=dealt)
    assert stalled == 0  # without the refund the first step waits forever: B_max is spent, half of it filtered


# ---- sync mode's step 4 ------------------------------------------------------------------------------------


class ThreadReduce:
    """``reduce_stats`` over ranks played by threads (the "group" is the rank): sums every rank's lists."""

    def __init__(self, ranks: int):
        self.barrier = threading.Barrier(ranks)
        self.slots: list = [None] * ranks

    def __call__(self, stats, group, op="sum"):
        self.slots[group] = stats
        self.barrier.wait()
        out = {
            key: [sum(column) for column in zip(*(slot[key] for slot in self.slots))] if isinstance(stats[key], list)
            else sum(slot[key] for slot in self.slots)
            for key in stats
        }
        self.barrier.wait()
        return out


def sync_rank(rank: int, world: int, prompts: int, signal, logged: list) -> SyncMode:
    """A SyncMode for step 4 alone: the run's prompt stream, and a round that 'generates' this rank's share
    (prompts r, r+W, ...) with rewards that have signal where ``signal(draw)``."""
    mode = SyncMode.__new__(SyncMode)
    cfg = SimpleNamespace(training=SimpleNamespace(prompts_per_step=prompts), reward=SimpleNamespace(dynamic_sampling=True))
    mode.parts = SimpleNamespace(cfg=cfg, rank=rank, world_size=world, trainer_group=rank,
                                 logger=SimpleNamespace(info=logged.append))
    mode.stream = SimpleNamespace(problem_at=lambda index: f"problem {index}")
    mode._drawn = 0
    mode._generate_round = lambda drawn, timer, stats: [
        s for draw, _ in drawn[rank::world] for s in group(draw, origin=rank, version=0, signal=signal(draw))
    ]
    return mode


def run_step_4(world: int, prompts: int, signal, monkeypatch) -> list:
    """Every rank's (kept draws, row, prompts drawn), each rank on a thread."""
    monkeypatch.setattr(sync_mode, "reduce_stats", ThreadReduce(world))
    logged: list = []
    results: list = [None] * world

    def rank_main(rank):
        mode = sync_rank(rank, world, prompts, signal, logged)
        drawn = mode.next_prompts(prompts)
        samples = mode._generate_round(drawn, None, None)
        kept, row = mode._keep_groups_with_signal(drawn, samples, StepTimer(), None)
        results[rank] = (sorted({s.draw for s in kept}), row, mode._drawn, len(kept))

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results + [logged]


def test_sync_keeps_exactly_p_groups_with_signal_drawing_the_missing_ones(monkeypatch):
    """P = 4 over 2 ranks; every draw divisible by 3 has no signal: round 1 (draws 0-3) keeps 1, 2; round 2 draws
    the 2 missing (4, 5), keeps both. Rank r generated its share of each round (r, r+2, ...)."""
    *ranks, logged = run_step_4(2, 4, lambda draw: draw % 3 != 0, monkeypatch)
    (kept0, row0, drawn0, samples0), (kept1, row1, drawn1, _) = ranks
    assert kept0 == [2, 4] and kept1 == [1, 5]  # 4 groups in all, each on the rank that generated it
    assert samples0 == 2 * GROUP
    # the policy's reward over all 6 groups generated is 4 / 24; the 4 kept groups' alone would say 4 / 16
    assert row0 == row1 == {"dynamic_sampling_filtered_frac": 2 / 6, "dynamic_sampling_rounds": 1, "received_reward_mean": 4 / 24}
    assert drawn0 == drawn1 == 6 and not logged


def test_sync_stops_after_the_extra_rounds_and_trains_on_what_it_kept(monkeypatch):
    """Only draw 1 has signal: after MAX_EXTRA_ROUNDS extra rounds the step keeps that one group (and says so)."""
    *ranks, logged = run_step_4(2, 4, lambda draw: draw == 1, monkeypatch)
    assert [kept for kept, *_ in ranks] == [[], [1]]
    row = ranks[0][1]
    assert row["dynamic_sampling_rounds"] == MAX_EXTRA_ROUNDS
    generated = 4 + 3 * MAX_EXTRA_ROUNDS  # a round draws only the missing three
    assert row["dynamic_sampling_filtered_frac"] == (generated - 1) / generated and ranks[0][2] == generated
    assert row["received_reward_mean"] == 1 / (generated * GROUP)  # one reward of 1 among every sample generated
    assert len(logged) == 2 and "1 of 4 groups" in logged[0]


def test_a_shard_that_only_receives_groups_without_signal_stops_the_run_with_one_line():
    """Eight batches' worth of uniform groups in a row (the policy solves every prompt or none) would leave the
    trainer waiting forever: the shard raises, naming the key; a group with signal in between resets the count."""
    receiver = shard(batch=8, num_rollout=1, dynamic_sampling=True)
    for draw in range(MAX_EXTRA_BATCHES * 2 - 1):  # 15 groups of 4: 60 samples, below 8 x 8
        receiver.accept_group(group(draw, 0, 0, signal=False), version=0)
    receiver.accept_group(group(99, 0, 0, signal=True), version=0)  # signal: the count starts again
    for draw in range(100, 100 + MAX_EXTRA_BATCHES * 2 - 1):
        receiver.accept_group(group(draw, 0, 0, signal=False), version=0)
    with pytest.raises(RuntimeError, match="reward.dynamic_sampling"):
        receiver.accept_group(group(200, 0, 0, signal=False), version=0)


def test_reinforce_pp_without_a_group_baseline_rejects_dynamic_sampling():
    """Whitened against the batch, a group of equal rewards has a nonzero advantage: dropping it would be wrong."""
    args = ["--reward.dynamic_sampling=true", "--advantage.estimator=reinforce_pp", "--advantage.group_baseline=false"]
    with pytest.raises(ConfigError, match="advantage.group_baseline"):
        validate(ConfigManager().parse_args(args))
    validate(ConfigManager().parse_args(args[:2]))  # with its group baseline it is fine


def test_a_group_differing_only_in_the_overlong_penalty_is_dropped():
    """DAPO filters on the outcome (accuracy): four wrong answers, one of them in the overlong buffer, carry no
    signal about the answer, though their shaped rewards differ."""
    samples = group(7, 0, 0, signal=False)
    samples[0].reward, samples[0].reward_parts = -0.5, {"task": 0.0, "overlong": -0.5}
    receiver = shard(batch=8, num_rollout=1, dynamic_sampling=True)
    receiver.accept_group(samples, version=0)
    assert len(receiver.buffer) == 0 and receiver.filtered == [4]
