"""The placement planner on synthetic windows, against hand-computed rates and predictions."""

import pickle
from dataclasses import replace

import pytest

from reflow.scheduler.placement import ForcedSchedule, PlacementController
from reflow.scheduler.planner import (
    Candidate,
    PlacementPlanner,
    PlacementRates,
    PlannerSettings,
    WindowMeasurement,
    least_squares_slope,
    significant_slope,
)


def planner(**overrides) -> PlacementPlanner:
    """Steps 7 and 8 off unless overridden (their defaults): the model alone decides."""
    settings = dict(world_size=4, shard_degree=1, replica_options=(1, 2, 3), sigma=0.5, batch_size=16, cooldown_steps=4,
                    margin=0.1, horizon_steps=4, transition_cost_s=2.0, ema=0.5, warmup_steps=0)
    settings.update(overrides)
    return PlacementPlanner(PlannerSettings(**settings))


def rows(steps=2, seconds=10.0, wait=5.0, trained=32, arrived=40, length=100.0, prompt=28, evicted=0, busy=10.0, idle=5.0,
         first_step=1) -> list[dict]:
    """A window of ``steps`` equal metrics rows with these totals."""
    return [
        {"step": first_step + k, "step_time_s": seconds / steps, "trainer_wait_s": wait / steps,
         "fresh_samples": trained // steps // 2, "replayed_samples": trained // steps - trained // steps // 2,
         "received_samples": arrived // steps, "received_response_len_mean": length, "evicted_unused": evicted // steps,
         "trainer_tokens": trained // steps * (prompt + length), "rollout_busy_s": busy / steps, "rollout_idle_s": idle / steps}
        for k in range(steps)
    ]


def test_rates_count_useful_tokens_per_unblocked_and_non_waiting_second():
    window = WindowMeasurement.from_rows(rows(evicted=8))
    p, c, prompt = planner().window_rates(window, replicas=1)
    assert p == pytest.approx((40 - 8) * 100 / 10.0)  # evicted samples are not useful; idle seconds do not dilute
    assert c == pytest.approx(32 * 128 / (10.0 - 5.0))  # per non-waiting second: starvation is not slowness
    assert prompt == pytest.approx(28)


def test_warm_up_steps_and_steps_without_a_rollout_report_are_left_out():
    window = rows(steps=2, first_step=1) + rows(steps=2, first_step=3, busy=0.0, idle=0.0) + rows(steps=2, first_step=5)
    measured = WindowMeasurement.from_rows(window, warmup_steps=2)
    assert measured.steps == 2 and measured.arrived == 40


def test_picks_the_hand_computed_placement():
    """p = 400 useful tokens per rollout rank-second, c = 819.2 tokens per replica-second, length 100 (no trend
    yet), prompt 28, sigma 0.5:
    1 replica + 3 rollout: P = 12/s,  C = 6.4/s,  X = min(C, P/0.5) = 6.4, step 16/6.4 = 2.5 s
    2 replicas + 2:        P = 8/s,   C = 12.8/s, X = 12.8, step 1.25 s, coverage 0.625 (in the band)
    3 replicas + 1:        P = 4/s,   C = 19.2/s, X = 8, step 2.0 s
    Best: 2 replicas, saving 4 steps x (2.5 - 1.25) = 5 s > the 2 s a transition costs."""
    decision = planner().decide(step=4, replicas=1, window=rows())
    throughput = {c.replicas: c.throughput for c in decision.candidates}
    assert throughput == pytest.approx({1: 6.4, 2: 12.8, 3: 8.0})
    assert {c.replicas: c.step_s for c in decision.candidates} == pytest.approx({1: 2.5, 2: 1.25, 3: 2.0})
    assert decision.target == 2 and decision.predicted_saving_s == pytest.approx(5.0)
    row = decision.as_row()
    assert row["planner_target_replicas"] == 2 and set(row["planner_throughput"]) == {"1", "2", "3"}


def test_margin_cooldown_and_transition_cost_hold_a_change_back():
    # the choice must beat the current throughput (6.4) by the margin: 12.8 < 2.5 x 6.4
    assert "margin" in planner(margin=1.5).decide(4, 1, rows()).reason
    # the start counts as a change: no move before cooldown_steps steps
    held = planner().decide(2, 1, rows())
    assert held.target is None and "cooling" in held.reason
    # saving 5 s does not pay for a 6 s transition
    assert "transition cost" in planner(transition_cost_s=6.0).decide(4, 1, rows()).reason


def test_one_window_moves_nothing_a_sustained_change_moves_within_three():
    """After a move to 2 replicas (training twice the samples: c stays 819.2 per replica), production falls to a
    quarter (busy 40 s for the same tokens: p = 100). The
    EMA (weight 0.5) gives p = 250, 175, 137.5, 118.75 over the next windows. n = 2 has
    X = min(12.8, 2 p / 100 / 0.5), n = 1 has X = min(6.4, 3 p / 100 / 0.5): 1 replica is the placement the
    last change left, so it needs twice the margin, 6.4 >= 1.2 x 0.04 p, p <= 133.3: the fourth window. The
    move saves 8 steps x (16 / 4.75 - 16 / 6.4) = 6.9 s > 2 s."""
    plan = planner(horizon_steps=8)
    assert plan.decide(4, 1, rows()).target == 2
    slow = rows(busy=40.0, trained=64)
    decisions = [plan.decide(step, 2, slow) for step in (8, 10, 12, 14)]
    assert [d.target for d in decisions] == [None, None, None, 1]
    assert "twice the margin" in decisions[2].reason  # 6.4 against 5.5: beyond the margin, not twice it
    assert decisions[-1].rates.production == pytest.approx(118.75)


def test_an_idle_side_re_decides_regardless_of_the_margin():
    """3 replicas + 1 rollout rank: the trainer waits half of every step (idle 0.5 > 0.3). With a margin no gain
    can beat, the planner holds for one window and moves toward the rollout side after the second."""
    plan = planner(margin=10.0, idle_windows=2)
    first = plan.decide(4, 3, rows(trained=96))  # (c = 819.2 per replica, as above)
    assert first.target is None and "margin" in first.reason
    second = plan.decide(6, 3, rows(trained=96, first_step=5))
    assert second.target == 2 and "trainer side idled" in second.reason


def test_the_idle_override_never_takes_a_placement_predicted_slower():
    """The live run's oscillation: the current placement is within TIE of the best but out of the band, so step
    4's tie-break picks an in-band one predicted slower. An idle trainer must not move the run to it."""
    plan = planner(margin=0.0, idle_windows=1, cooldown_steps=0)
    current = Candidate(3, 1, production=20.0, consumption=10.0, throughput=10.0, coverage=2.0, step_s=1.6)
    slower_in_band = Candidate(2, 2, production=7.0, consumption=10.1, throughput=9.9, coverage=0.69, step_s=1.62)
    plan.candidates = lambda rates, replicas: [current, slower_in_band]
    decision = plan.decide(4, 3, rows(trained=96))  # the trainer waits half of every step
    assert plan.idle_streak["trainer"] == 1 and plan.choose([current, slower_in_band], 3) is slower_in_band
    assert decision.target is None and "margin" in decision.reason
    faster_in_band = Candidate(2, 2, production=7.0, consumption=10.5, throughput=10.1, coverage=0.67, step_s=1.58)
    plan.candidates = lambda rates, replicas: [current, faster_in_band]
    decision = plan.decide(6, 3, rows(trained=96, first_step=5))
    assert decision.target == 2 and "trainer side idled" in decision.reason


def test_a_growing_length_is_predicted_at_the_horizon():
    plan = planner(horizon_steps=10)
    plan.decide(4, 2, rows(length=100.0))
    decision = plan.decide(6, 2, rows(length=200.0, first_step=3))
    # smoothed length 150; the slope through (4, 100) and (6, 200) is 50 a step: 150 + 50 x 10 / 2 = 400, kept
    # within twice the length
    assert decision.rates.length == pytest.approx(150.0) and decision.rates.length_trend == pytest.approx(50.0)
    assert decision.predicted_length == pytest.approx(300.0)
    # a third window back at 150: the least-squares slope through the three is 12.5 (a one-window difference
    # would say -25), but its standard error is 43 (residuals 12.5, -25, 12.5): scatter, no trend. The
    # smoothed length stays 150, and so does the prediction
    decision = plan.decide(8, 2, rows(length=150.0, first_step=5))
    assert decision.rates.length_trend == 0.0 and decision.predicted_length == pytest.approx(150.0)
    # windows older than the horizon leave the slope: (8, 150) and (16, 150) are flat
    decision = plan.decide(16, 2, rows(length=150.0, first_step=9))
    assert decision.rates.length_trend == pytest.approx(0.0) and decision.predicted_length == pytest.approx(150.0)
    # a steady growth over four windows stands out of its scatter: 40, 62, 78, 100 a window apart (slope 9.8 a
    # step, standard error 0.4)
    plan = planner(horizon_steps=10)
    for step, length in ((2, 40.0), (4, 62.0), (6, 78.0), (8, 100.0)):
        decision = plan.decide(step, 2, rows(length=length, first_step=step - 1))
    assert decision.rates.length_trend == pytest.approx(9.8)


def test_a_trend_counts_only_beyond_the_scatter():
    """The rollout-bound bench's windows: lengths scattered about a steady 14 (0 to 39 tokens) have a
    least-squares slope in every span, which the prediction followed to half and twice the length."""
    scattered = [(2, 12.0), (4, 19.0), (6, 10.0), (8, 3.0), (10, 32.0), (12, 6.0), (14, 15.0)]
    assert least_squares_slope(scattered) != 0.0 and significant_slope(scattered) == 0.0
    assert significant_slope([(2, 10.0), (4, 12.0), (6, 14.5), (8, 16.0)]) == pytest.approx(1.025)
    assert significant_slope([(2, 10.0), (4, 30.0)]) == pytest.approx(10.0)  # two points: no scatter to judge by


def test_ties_go_to_the_fresh_coverage_band():
    plan = planner()
    out_of_band = Candidate(1, 3, production=20.0, consumption=10.0, throughput=10.0, coverage=2.0, step_s=1.6)
    in_band = Candidate(3, 1, production=7.0, consumption=10.1, throughput=9.9, coverage=0.69, step_s=1.62)
    assert plan.choose([out_of_band, in_band], replicas=1) is in_band
    assert plan.choose([out_of_band, Candidate(3, 1, 4.0, 12.0, 8.0, 0.33, 2.0)], replicas=3) is out_of_band


def test_a_measured_transition_replaces_the_configured_cost():
    plan = planner(transition_cost_s=0.5)
    window = rows() + [{"transition": "T1x1+R3 -> T2x1+R2", "transition_s": 7.5}]
    decision = plan.decide(4, 1, window)
    assert decision.transition_cost_s == 7.5 and decision.target is None  # 5 s saved < 7.5 s measured


def test_stays_when_the_window_measured_nothing():
    decision = planner().decide(4, 1, rows(arrived=0))
    assert decision.target is None and decision.candidates == []


def test_both_controllers_implement_the_interface():
    assert isinstance(planner(), PlacementController)
    schedule = ForcedSchedule([(4, 2)])
    assert isinstance(schedule, PlacementController)
    assert schedule.decide(4, 1, []).target == 2
    assert schedule.decide(4, 2, []).target is None and schedule.decide(5, 1, []).target is None


def test_a_move_back_needs_twice_the_margin_and_no_idle_waiver():
    """After 2 -> 1 replicas, the rollout ranks idle (the expected cost of the trade) and 2 replicas is
    predicted 15% faster: beyond the 10% margin, not beyond twice it, so the run stays, idle or not; at 25%
    it moves back. A move to a third placement needs only the margin."""
    plan = planner(margin=0.1, idle_windows=1, cooldown_steps=0, transition_cost_s=0.0)
    plan.candidates = lambda rates, replicas: [
        Candidate(1, 3, 30.0, 10.0, 10.0, 3.0, 1.6), Candidate(2, 2, 20.0, 5.0, 5.0, 4.0, 3.2)]
    assert plan.decide(4, 2, rows()).target == 1 and plan.left == 2
    here = Candidate(1, 3, production=30.0, consumption=5.0, throughput=5.0, coverage=6.0, step_s=3.2)
    plan.candidates = lambda rates, replicas: [here, Candidate(2, 2, 20.0, 5.75, 5.75, 3.5, 16 / 5.75)]
    held = plan.decide(6, 1, rows(idle=10.0, first_step=5))  # rollout idle 0.5 > 0.3 for a window
    assert plan.idle_streak["rollout"] == 1 and held.target is None and "twice the margin" in held.reason
    elsewhere = Candidate(3, 1, 10.0, 5.75, 5.75, 1.7, 16 / 5.75)  # the same 15%, to a placement not just left
    plan.candidates = lambda rates, replicas: [here, elsewhere]
    assert plan.decide(8, 1, rows(first_step=7)).target == 3 and plan.left == 1
    there = Candidate(3, 1, 10.0, 5.0, 5.0, 2.0, 3.2)
    plan.candidates = lambda rates, replicas: [Candidate(1, 3, 30.0, 5.75, 5.75, 5.2, 16 / 5.75), there]
    assert plan.decide(10, 3, rows(first_step=9)).target is None  # 15% back to 1: held
    plan.candidates = lambda rates, replicas: [Candidate(1, 3, 30.0, 6.25, 6.25, 4.8, 16 / 6.25), there]
    back = plan.decide(12, 3, rows(first_step=11))
    assert back.target == 1 and "twice the margin" in back.reason


def test_a_restored_planner_decides_as_the_one_it_was_saved_from():
    """The scenario above, saved after step 10 and restored (through pickle, as a checkpoint stores it): the
    restored planner and the uninterrupted one make the same decisions at steps 12 and 14, [stay, move to 1].
    A planner that forgot (a fresh one on the same windows) moves at 12: its first window is all it has seen,
    and nothing tells it that 1 replica is the placement the last change left."""
    uninterrupted = planner(horizon_steps=8)
    slow = rows(busy=40.0, trained=64)
    assert uninterrupted.decide(4, 1, rows()).target == 2
    assert [uninterrupted.decide(step, 2, slow).target for step in (8, 10)] == [None, None]
    restored = planner(horizon_steps=8)
    restored.load_state(pickle.loads(pickle.dumps(uninterrupted.state())))
    assert restored.state() == uninterrupted.state()
    for step, target in ((12, None), (14, 1)):
        kept, resumed = uninterrupted.decide(step, 2, slow), restored.decide(step, 2, slow)
        assert kept.as_row() == resumed.as_row() and kept.target == target, step
    assert restored.state() == uninterrupted.state()
    assert planner(horizon_steps=8).decide(12, 2, slow).target == 1


def test_the_forced_schedule_keeps_no_state():
    schedule = ForcedSchedule([(4, 2)])
    assert schedule.state() == {}
    schedule.load_state({})
    with pytest.raises(ValueError, match="placement.schedule"):
        schedule.load_state({"left": 1})


def measured_world(trained_by_replicas: dict[int, int], arrived: int):
    """Windows of a machine the model misjudges: a trainer that never waits trains ``trained_by_replicas[n]``
    samples of 128 tokens in every 10 s window at n replicas (c = trained x 128 / 10 / n per replica, which the
    model scales linearly), and a rollout rank makes ``arrived`` x 100 useful tokens per 10 busy seconds."""
    def window(replicas: int, step: int) -> list[dict]:
        return rows(trained=trained_by_replicas[replicas], wait=0.0, arrived=arrived, idle=0.0, first_step=step - 1)
    return window


def run(plan: PlacementPlanner, window, start: int, until: int, first: int = 4) -> list[tuple[int, int]]:
    """Decide every 2 steps from step ``first`` at ``start`` replicas; returns the (step, replicas) of every move."""
    replicas, moves = start, []
    for step in range(first, until + 1, 2):
        decision = plan.decide(step, replicas, window(replicas, step))
        if decision.target is not None:
            replicas = decision.target
            moves.append((step, replicas))
    return moves


def test_a_placement_measured_slower_per_replica_overrules_the_model_and_the_move_back_needs_only_the_margin():
    """The trainer-heavy CPU bench: 2 replicas train 170 samples a window, 3 only 120 and 1 150 (an all-reduce
    and an optimizer step per replica on shared cores), where the model scales 2's rate to 3 x 8.5 = 25.5/s.
    The first window (step 4) is the start's and left out, so 2 is measured at step 6; it moves to 3 then,
    measures 3's own c (120 x 128 / 10 / 3 = 512 tokens per replica-second against 2's 1088), and goes back
    at the first decision after the cooldown (step 10) with the plain margin; it then tries 1 replica, the
    unmeasured neighbour (step 14), goes back again (step 18), and stays: every neighbour of the best is
    measured."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    world = measured_world({1: 150, 2: 170, 3: 120}, arrived=400)
    assert run(plan, world, start=2, until=40) == [(6, 3), (10, 2), (14, 1), (18, 2)]
    assert plan.decisions[0].reason == "measuring the current placement before judging it"
    assert "exploring 1 replicas" in plan.decisions[5].reason
    assert plan.by_placement[3].consumption == pytest.approx(120 * 128 / 10 / 3)
    assert plan.by_placement[1].consumption == pytest.approx(150 * 128 / 10)
    final = plan.decisions[-1]
    assert {c.replicas: c.throughput for c in final.candidates} == pytest.approx({1: 15.0, 2: 17.0, 3: 12.0})
    assert final.as_row()["planner_measured"] == [1, 2, 3]


def test_own_rates_are_per_token_so_a_placement_measured_on_other_lengths_still_predicts():
    """A placement's rates measured on 100-token answers predict it on 200-token ones through the length (step
    3): 3 replicas measured at c = 512 tokens per replica-second, asked at length 200 (prompt 28), consume
    3 x 512 / 228 = 6.74 samples/s, not a figure from another workload."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100)
    world = measured_world({1: 150, 2: 170, 3: 120}, arrived=400)
    plan.decide(4, 3, world(3, 4))
    longer = rows(trained=20, wait=0.0, arrived=400, idle=0.0, length=200.0, first_step=5)
    decision = plan.decide(6, 3, longer)
    own = plan.by_placement[3]
    length = plan.predicted_length(decision.rates)
    by_replicas = {c.replicas: c for c in decision.candidates}
    assert by_replicas[3].consumption == pytest.approx(3 * own.consumption / (decision.rates.prompt_tokens + length))
    assert by_replicas[3].measured and not by_replicas[2].measured


def test_exploration_finds_the_placement_the_model_puts_at_half():
    """The rollout-heavy CPU bench: the model, at 2 replicas, predicts 1 at half of 2 (8.5 against 17
    samples/s) and 3 at 12; measured, 1 trains 1.4x what 2 does, and 3, fed by one rollout rank, 12/s. The
    run's first window is left out of 2's own rates (start-up), so the planner waits a window (step 4), tries
    3 (the model's favourite neighbour, step 6), goes back to 2 (measured 1.4x 3, step 10), tries 1 (2's other
    neighbour, step 14), and keeps it."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    world = measured_world({1: 238, 2: 170, 3: 120}, arrived=60)
    first = plan.decide(4, 2, world(2, 4))
    assert {c.replicas: c.throughput for c in first.candidates} == pytest.approx({1: 8.5, 2: 17.0, 3: 12.0})
    assert first.target is None and plan.by_placement == {}
    assert run(plan, world, start=2, until=40, first=6) == [(6, 3), (10, 2), (14, 1)]
    assert "exploring 3 replicas" in plan.decisions[1].reason and "exploring 1 replicas" in plan.decisions[5].reason
    assert [d.target for d in plan.decisions[5:]] == [1] + [None] * 13
    assert {c.replicas: c.throughput for c in plan.decisions[-1].candidates} == pytest.approx({1: 23.8, 2: 17.0, 3: 12.0})


def test_trials_start_only_from_the_best_measured_placement():
    """Standing in 3 replicas, measured below 2 (within the margin, so step 4 stays), the planner does not try 1,
    the best's unmeasured neighbour: that would move two replicas' worth of ranks from a placement that is not
    the best; trials start from the best."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1, margin=1.0)
    world = measured_world({1: 238, 2: 170, 3: 160}, arrived=400)
    plan.by_placement = {2: PlacementRates(4000.0, 170 * 128 / 10 / 2, 14), 3: PlacementRates(4000.0, 160 * 128 / 10 / 3, 18)}
    plan.settled, plan.last_change_step = True, 10
    decision = plan.decide(20, 3, world(3, 20))
    assert {c.replicas for c in decision.candidates if c.measured} == {2, 3}
    assert max((c for c in decision.candidates if c.measured), key=lambda c: c.throughput).replicas == 2
    assert decision.target is None and "exploring" not in decision.reason
    # standing in 2, the best, the same memory tries 1
    plan.by_placement[3] = replace(plan.by_placement[3], step=20)
    assert plan.decide(22, 2, world(2, 22)).target == 1


def test_exploration_waits_for_a_measured_window_and_respects_its_budget_and_memory():
    world = measured_world({1: 238, 2: 170, 3: 120}, arrived=60)
    # two 2 s transitions are more than 10% of 20 predicted steps of 0.94 s: the model alone decides
    costly = planner(horizon_steps=20, transition_cost_s=2.0, memory_steps=100, explore_budget=0.1)
    assert run(costly, world, start=2, until=20) == []
    # nothing measured in the window (its steps were warm-up): no trial
    assert planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1,
                   warmup_steps=10).decide(4, 2, world(2, 4)).target is None
    # rates older than memory_steps are forgotten, and the neighbours are tried again
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=12, explore_budget=0.1)
    moves = run(plan, world, start=2, until=40)
    assert moves[:3] == [(6, 3), (10, 2), (14, 1)] and len(moves) > 3
    assert all(own.step > 40 - 12 for own in plan.by_placement.values())


def test_a_window_with_no_length_is_not_a_measurement():
    """Nothing arrived (length 0): no placement's rates are kept, and no length divides by zero."""
    plan = planner(memory_steps=100, explore_budget=0.1)
    assert plan.decide(4, 2, rows(arrived=0)).target is None
    assert plan.by_placement == {}


def test_own_rates_survive_a_checkpoint():
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    world = measured_world({1: 150, 2: 170, 3: 120}, arrived=400)
    run(plan, world, start=2, until=10)
    again = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    again.load_state(pickle.loads(pickle.dumps(plan.state())))
    assert again.by_placement == plan.by_placement and again.state() == plan.state()


def test_a_placement_is_measured_before_it_is_judged():
    """The live trainer-heavy bench: a trial of 1 replica whose only window so far was the transition's (left
    out) went back to 2 on the all-windows rates, and tried 1 again two windows later. Now the run stays in an
    unmeasured placement until a window of its own is kept, and then judges it on its own rates; a placement
    whose windows measure nothing is left after twice the cooldown as before."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    world = measured_world({1: 150, 2: 170, 3: 120}, arrived=400)
    plan.by_placement = {2: PlacementRates(4000.0, 170 * 128 / 10 / 2, 20), 3: PlacementRates(4000.0, 512.0, 16)}
    plan.last_change_step, plan.left, plan.settled = 20, 2, False  # step 20 began a trial of 1 replica
    # the transition's steps were shorter than the rollout's report period: nothing measured
    unreported = rows(trained=60, wait=0.0, arrived=400, busy=0.0, idle=0.0, first_step=21)
    assert plan.decide(22, 1, unreported).target is None
    # the first kept window is left out (the transition's); past the cooldown, the run still stays to measure
    first = plan.decide(24, 1, world(1, 24))
    assert first.target is None and first.reason == "measuring the current placement before judging it"
    assert 1 not in plan.by_placement and {c.replicas: c.throughput for c in first.candidates}[2] > 1.1 * 15.0
    # measured at 150 a window against 2's 170 (beyond the margin): it goes back on measurements
    decision = plan.decide(26, 1, world(1, 26))
    assert plan.by_placement[1].consumption == pytest.approx(150 * 128 / 10) and decision.target == 2
    # windows that measure nothing hold a placement for twice the cooldown, no longer
    idle = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    idle.load_state(plan.state())
    idle.last_change_step, idle.settled = 26, False
    idle.by_placement.pop(2)
    assert idle.measuring(33, 2) and not idle.measuring(34, 2)


def test_a_placement_left_is_remembered_by_its_whole_stay():
    """The live rollout-bound bench left 1 replica on one slow window, and the smoothed rates of that moment
    (chosen for being low) stood for the placement while the run trained 50 steps in a slower one. A placement
    the run has left is predicted from the ratios of its latest stay's sums instead: three windows of 150
    samples and one of 50 consume (3 x 150 + 50) / 4 = 125 a window, where the smoothed rate fell to 100."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, margin=10.0)
    world = measured_world({1: 150, 2: 170, 3: 120}, arrived=400)
    for step in (4, 6, 8, 10):  # (step 4's window is the start's, left out)
        plan.decide(step, 1, world(1, step))
    slow = rows(trained=50, wait=0.0, arrived=400, idle=0.0, first_step=11)
    standing = plan.decide(12, 1, slow)
    per_sample = 128.0  # the trained tokens of a sample (28 + 100)
    assert plan.by_placement[1].consumption == pytest.approx(100 * per_sample / 10)  # the smoothed rate, in 1
    assert {c.replicas: c.consumption for c in standing.candidates}[1] == pytest.approx(10.0)
    plan.last_change_step, plan.left, plan.settled = 12, 1, False  # the run moves to 2 replicas
    away = plan.decide(14, 2, world(2, 14))
    assert {c.replicas: c.consumption for c in away.candidates}[1] == pytest.approx(12.5)
    # a later stay in 1 starts its own sums
    plan.last_change_step, plan.left, plan.settled = 14, 2, True
    plan.decide(16, 1, rows(trained=80, wait=0.0, arrived=400, idle=0.0, first_step=15))
    assert plan.by_placement[1].stay_average(1).consumption == pytest.approx(80 * per_sample / 10)


def test_an_idle_side_waives_the_margin_only_toward_an_unmeasured_placement():
    """The live trainer-heavy bench: its rollout ranks idle in its best split (2 replicas), and the idle waiver
    took the run to 3 replicas, measured within the margin of 2, twice. A measured placement's rates already show
    what the idle side costs there: the margin holds."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, idle_windows=2)
    plan.by_placement = {3: PlacementRates(4000.0, 180 * 128 / 10 / 3, 20)}  # 3 measured 180 a window: 1.06x 2
    plan.last_change_step, plan.settled = 20, True
    idle_rollout = [rows(trained=170, wait=0.0, arrived=400, busy=5.0, idle=5.0, first_step=step - 1) for step in (22, 24)]
    decisions = [plan.decide(step, 2, window) for step, window in zip((22, 24), idle_rollout)]
    assert plan.idle_streak["rollout"] == 2
    assert decisions[-1].target is None and "within the margin" in decisions[-1].reason
    # the same idle run with 3 unmeasured: the waiver takes the model's choice
    fresh = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, idle_windows=2)
    fresh.by_placement = {2: PlacementRates(4000.0, 170 * 128 / 10 / 2, 20)}
    fresh.last_change_step, fresh.settled = 20, True
    moves = [fresh.decide(step, 2, window).target for step, window in zip((22, 24), idle_rollout)]
    assert moves == [None, 3]


def test_a_placement_returned_to_is_measured_again_before_it_is_judged():
    """The live rollout-bound bench went between 1 and 2 replicas every 4 steps for 80 steps: back in 1, the run
    judged it on the smoothed rates of the moment it had last left it (chosen for being low), before this stay
    had a window of its own. A stay now starts its own rates: the run measures again, then judges."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, margin=0.2, replica_options=(1, 2))
    world = measured_world({1: 150, 2: 170, 3: 120}, arrived=400)
    low = rows(trained=50, wait=0.0, arrived=400, idle=0.0)
    plan.by_placement = {1: PlacementRates(4000.0, 50 * 128 / 10, 10), 2: PlacementRates(4000.0, 170 * 128 / 10 / 2, 20)}
    plan.last_change_step, plan.left, plan.settled = 20, 2, False  # step 20 returned to 1 replica
    assert plan.decide(22, 1, world(1, 22)).target is None  # the transition's window, left out
    back = plan.decide(24, 1, world(1, 24))  # past the cooldown: the stay's first kept window
    assert back.target is None and plan.by_placement[1].consumption == pytest.approx(150 * 128 / 10)  # not 100
    assert plan.by_placement[1].stay_trained_tokens == pytest.approx(150 * 128)
    # a slow window in the same stay blends in
    plan.decide(26, 1, [dict(r, step=r["step"] + 25) for r in low])
    assert plan.by_placement[1].consumption == pytest.approx(100 * 128 / 10)


def test_a_trial_measured_slower_than_the_placement_it_left_goes_back_within_the_margin():
    """The simulator at 32 GPUs: a trial of 1 replica measured 13.4 samples/s against 2's 14.4, inside the 10%
    margin, and the run stayed in the slower trial for 10 of its 24 steps. A trial is a question, judged once on
    its own rates after its cooldown: here 1 trains 16/s against 2's 17/s, and the run goes back at the
    judgement (step 18), while a trial measured faster, within the margin too (1 at 17.5/s), is kept, and is not
    judged again."""
    plan = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    assert run(plan, measured_world({1: 160, 2: 170, 3: 120}, arrived=400), start=2, until=40) == [
        (6, 3), (10, 2), (14, 1), (18, 2)]
    back = next(d for d in plan.decisions if d.step == 18)
    assert "the trial measured slower than the placement it left" in back.reason
    assert plan.trial_from is None
    kept = planner(horizon_steps=20, transition_cost_s=0.1, memory_steps=100, explore_budget=0.1)
    assert run(kept, measured_world({1: 175, 2: 170, 3: 120}, arrived=400), start=2, until=40) == [
        (6, 3), (10, 2), (14, 1)]
    assert kept.trial_from is None and kept.state()["trial_from"] is None
