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
