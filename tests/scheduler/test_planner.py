"""The placement planner (Algorithm 1) on synthetic windows, against hand-computed rates and scores."""

import math

import pytest

from reflow.scheduler.planner import PlacementPlanner, PlannerSettings, WindowMeasurement
from reflow.scheduler.placement import ForcedSchedule, PlacementController


def planner(**overrides) -> PlacementPlanner:
    settings = dict(world_size=4, shard_degree=1, replica_options=(1, 2, 3), sigma=0.5, batch_size=16, cooldown_steps=4,
                    margin=0.1, horizon_steps=4, transition_cost_s=2.0)
    settings.update(overrides)
    return PlacementPlanner(PlannerSettings(**settings))


def rows(steps=2, seconds=10.0, wait=5.0, trained=32, produced=40, busy=10.0, idle=5.0) -> list[dict]:
    """A window of ``steps`` equal metrics rows with these totals."""
    return [
        {"step_time_s": seconds / steps, "trainer_wait_s": wait / steps, "fresh_samples": trained // steps // 2,
         "replayed_samples": trained // steps - trained // steps // 2, "received_samples": produced // steps,
         "rollout_busy_s": busy / steps, "rollout_idle_s": idle / steps}
        for _ in range(steps)
    ]


def test_rates_count_only_unblocked_and_non_waiting_time():
    window = WindowMeasurement.from_rows(rows())
    p, c = planner().rates(window, replicas=1)
    assert p == pytest.approx(40 / 10.0)  # per busy rank-second: the 5 idle seconds do not dilute it
    assert c == pytest.approx(32 / (10.0 - 5.0))  # per non-waiting second: starvation is not slowness


def test_picks_the_hand_computed_placement():
    """p = 4/s per rollout rank, c = 6.4/s per replica, sigma 0.5 (target coverage 0.5):
    1 replica + 3 rollout: P/C = 12/6.4, score |ln(3.75)| = 1.32, step 16/6.4 = 2.5 s
    2 replicas + 2:        P/C = 8/12.8, score |ln(1.25)| = 0.22, step 16/12.8 = 1.25 s
    3 replicas + 1:        P/C = 4/19.2, score |ln(0.417)| = 0.88, step 16/8 = 2.0 s
    Best: 2 replicas, saving 4 steps x (2.5 - 1.25) = 5 s > the 2 s a transition costs."""
    decision = planner().decide(step=4, replicas=1, window=rows())
    scores = {c.replicas: c.score for c in decision.candidates}
    assert scores[1] == pytest.approx(math.log(3.75))
    assert scores[2] == pytest.approx(math.log(1.25))
    assert scores[3] == pytest.approx(abs(math.log(4 / 19.2 / 0.5)))
    assert {c.replicas: c.step_s for c in decision.candidates} == pytest.approx({1: 2.5, 2: 1.25, 3: 2.0})
    assert decision.target == 2 and decision.predicted_saving_s == pytest.approx(5.0)
    row = decision.as_row()
    assert row["planner_target_replicas"] == 2 and set(row["planner_scores"]) == {"1", "2", "3"}


def test_margin_cooldown_and_transition_cost_hold_a_change_back():
    # the best must beat the current score (1.32) by the margin: 0.22 + 1.2 > 1.32
    assert planner(margin=1.2).decide(4, 1, rows()).target is None
    # the start counts as a change: no move before cooldown_steps steps
    held = planner().decide(2, 1, rows())
    assert held.target is None and "cooling" in held.reason
    # after a change at step 4, the next is possible at step 8, not 6
    plan = planner()
    assert plan.decide(4, 1, rows()).target == 2
    reverse = rows(trained=64, busy=40.0)  # now production is short: fewer replicas would do better
    assert "cooling" in plan.decide(6, 2, reverse).reason
    assert plan.decide(8, 2, reverse).target is not None
    # saving 5 s does not pay for a 6 s transition
    assert "transition cost" in planner(transition_cost_s=6.0).decide(4, 1, rows()).reason


def test_a_measured_transition_replaces_the_configured_cost():
    plan = planner(transition_cost_s=0.5)
    window = rows() + [{"transition": "T1x1+R3 -> T2x1+R2", "transition_s": 7.5}]
    decision = plan.decide(4, 1, window)
    assert decision.transition_cost_s == 7.5 and decision.target is None  # 5 s saved < 7.5 s measured


def test_stays_when_the_window_measured_nothing():
    decision = planner().decide(4, 1, rows(produced=0))
    assert decision.target is None and decision.candidates == []


def test_both_controllers_implement_the_interface():
    assert isinstance(planner(), PlacementController)
    schedule = ForcedSchedule([(4, 2)])
    assert isinstance(schedule, PlacementController)
    assert schedule.decide(4, 1, []).target == 2
    assert schedule.decide(4, 2, []).target is None and schedule.decide(5, 1, []).target is None
