"""``python -m reflow.bench placement``: every run it launches is a config the start-up checks accept (the
world of 4, the split, the batch over the shards), so the benchmark cannot fail at its third run."""

import pytest

from reflow.bench.placement import STATIC, WORKLOADS, WORLD, placement_overrides, summarize
from reflow.config import ConfigManager
from reflow.config.validate import validate, validate_world


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("run", [*STATIC, "adaptive"])
def test_every_run_passes_the_start_up_checks(workload, run):
    config, extra = WORKLOADS[workload]
    cfg = ConfigManager().parse_args(["--config", config, *extra, *placement_overrides(run)])
    validate(cfg)
    placement = validate_world(cfg, WORLD)
    trainers = STATIC.get(run, WORLD // 2)
    assert (placement.num_trainer_ranks, placement.num_rollout_ranks) == (trainers, WORLD - trainers)
    assert cfg.scheduler.adaptive_placement is (run == "adaptive")


def test_the_summary_counts_steps_past_the_warm_up_and_each_placement():
    rows = [{"step": k, "loss": 0.0, "step_time_s": 2.0, "trainer_tokens": 100 * k, "fresh_samples": 4,
             "trainer_idle_ratio": 0.5, "rollout_idle_ratio": 0.25, "placement": "T2x1+R2" if k < 4 else "T1x1+R3"}
            for k in range(1, 6)]
    rows.insert(3, {"step": 3, "planner_current_replicas": 2, "planner_target_replicas": 1, "planner_reason": "rollout-bound"})
    out = summarize(rows, warmup=2)
    assert out["steps"] == 5 and out["tokens_per_s"] == (300 + 400 + 500) / 6.0
    assert out["steps_per_placement"] == {"T2x1+R2": 3, "T1x1+R3": 2}
    assert out["decisions"] == [{"step": 3, "planner_current_replicas": 2, "planner_target_replicas": 1,
                                 "planner_reason": "rollout-bound"}]


def test_rounds_rotate_the_order_and_the_target_is_judged_on_means():
    """Round 1 runs the adaptive run last, round 2 first; the best static split is the best mean over the rounds,
    and each round's ratio is against that split."""
    from reflow.bench.placement import judge, round_orders

    assert round_orders(2) == [["static_1:3", "static_2:2", "static_3:1", "adaptive"],
                               ["adaptive", "static_1:3", "static_2:2", "static_3:1"]]
    tokens = [{"static_1:3": 100.0, "static_2:2": 120.0, "static_3:1": 90.0, "adaptive": 96.0},
              {"static_1:3": 120.0, "static_2:2": 110.0, "static_3:1": 80.0, "adaptive": 121.0}]
    judged = judge([{name: {"tokens_per_s": value} for name, value in r.items()} for r in tokens])
    assert judged["best_static"] == "static_2:2"  # means 110, 115 and 85
    assert judged["tokens_per_s"]["adaptive"] == 108.5
    assert judged["adaptive_vs_best_static"] == 108.5 / 115.0 and not judged["met"]
    assert judged["per_round"] == [96.0 / 120.0, 121.0 / 110.0]
