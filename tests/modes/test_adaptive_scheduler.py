"""The adaptive scheduler live: reflow mode on 4 ranks with the concurrency controller, the KV rule and the
placement planner on. Whatever the planner decides on this noisy machine, every decision is logged with the
predicted throughput of every feasible placement, the rollout workers' gate statistics and the global dispatcher's grants
reach the metrics, and no sample is lost, duplicated or trained staler than delta."""

import json
import os

import torch

from tests.modes.decoupled_runs import assert_no_sample_lost_or_duplicated, run_decoupled


def test_reflow_with_the_adaptive_scheduler_logs_every_decision_and_loses_nothing(tmp_path):
    rows, ledgers = run_decoupled(
        tmp_path, 4, "reflow", 3,
        [
            "--training.steps=10", "--replay.sigma=0.5", "--replay.delta=2", "--weight_sync.interval=1",
            "--placement.trainer_replicate_degree=1", "--placement.trainer_shard_degree=1",
            "--rollout.kv_block_size=32", "--rollout.num_kv_blocks=64", "--rollout.max_new_tokens=48",
            "--scheduler.adaptive_concurrency=true", "--scheduler.kv_admission=true", "--scheduler.adaptive_placement=true",
            "--scheduler.interval_s=0.2", "--scheduler.cooldown_steps=2", "--scheduler.margin=0",
            "--scheduler.horizon_steps=1000", "--scheduler.transition_cost_s=0",
            "--checkpoint.enable=true", "--checkpoint.interval=5", "--checkpoint.export_hf=false",
        ],
    )
    assert [r["step"] for r in rows] == list(range(1, 11))
    lines = [json.loads(line) for line in open(os.path.join(tmp_path, "reflow", "metrics.jsonl"))]
    decisions = [r for r in lines if "planner_reason" in r]
    assert [d["step"] for d in decisions] == list(range(1, 10))  # every sync point but the last step's
    scored = [d for d in decisions if "planner_throughput" in d]
    assert scored, [d["planner_reason"] for d in decisions]
    for d in scored:
        assert set(d["planner_throughput"]) == {"1", "2", "3"}  # every feasible trainer placement on 4 ranks
        assert d["planner_production_tokens_per_rank_s"] > 0 and d["planner_consumption_tokens_per_replica_s"] > 0
        # a move goes to a best-predicted placement, or tries one never measured (the planner's step 8)
        if d["planner_reason"].startswith("exploring"):
            assert d["planner_target_replicas"] not in d["planner_measured"]
        elif d["planner_target_replicas"] != d["planner_current_replicas"]:
            best = max(d["planner_throughput"].values())
            assert d["planner_throughput"][str(d["planner_target_replicas"])] >= (1 - 0.02) * best
    # a decision to move is carried out after that step, and the rows follow the placement
    moves = [d for d in decisions if d["planner_target_replicas"] != d["planner_current_replicas"]]
    changes = [r for r in lines if "transition" in r]
    assert [c["after_step"] if "after_step" in c else c["step"] for c in changes] == [d["step"] for d in moves]
    for move in moves:
        after = next(r for r in rows if r["step"] == move["step"] + 1)
        assert after["placement"].startswith(f"T{move['planner_target_replicas']}x1+")
    # the rollout workers' gate: caps within [group_size, max_num_seqs], KV usage a fraction
    reported = [r for r in rows if r["concurrency_caps"]]
    assert reported
    for r in reported:
        assert all(4 <= cap <= 128 for cap in r["concurrency_caps"].values())
        assert 0.0 <= r["kv_usage_mean"] <= 1.0 and r["preemptions"] >= 0
    started_groups = sum(len(led["started"]) for led in ledgers) // 4
    assert 0 < sum(r["admitted_groups"] for r in rows) <= started_groups
    # the global dispatcher granted every group that started, each to a rollout rank (rank 0 trains throughout)
    for r in rows:
        assert set(r["dispatched_groups"]) <= {"1", "2", "3"}
    assert sum(sum(r["dispatched_groups"].values()) for r in rows) >= started_groups
    for r in rows:  # the staleness bound, exactly
        assert len(r["staleness_counts"]) == 3
    assert_no_sample_lost_or_duplicated(rows, ledgers)
    # the checkpoint after step 5 holds the planner's memory as of its decision at step 5: the last change it
    # made by then, the placement that change left, and no rows since (every step is a sync point)
    saved = torch.load(os.path.join(tmp_path, "reflow", "checkpoint", "step-5", "placement-controller.pt"), weights_only=False)
    made = [d for d in moves if d["step"] <= 5]
    assert saved["window"] == []
    memory = saved["controller"]
    assert memory["last_change_step"] == (made[-1]["step"] if made else 0)
    assert memory["left"] == (made[-1]["planner_current_replicas"] if made else None)
    rated = [d for d in decisions if d["step"] <= 5 and "planner_production_tokens_per_rank_s" in d]
    if rated:  # the smoothed rates the step-5 decision (or the latest before it) used
        assert memory["smoothed"]["production"] == rated[-1]["planner_production_tokens_per_rank_s"]
        assert memory["smoothed"]["consumption"] == rated[-1]["planner_consumption_tokens_per_replica_s"]
    else:
        assert memory["smoothed"] is None
