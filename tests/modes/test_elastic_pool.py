"""The elastic pool under torchrun: a reflow run on 4 ranks whose trainer shrinks from 2 replicas to 1 and grows
back, by placement.schedule, without a restart."""

import collections
import json
import os

from tests.modes.decoupled_runs import assert_no_sample_lost_or_duplicated, run_decoupled


def test_reflow_run_changes_placement_both_ways_and_loses_nothing(tmp_path):
    rows, ledgers = run_decoupled(
        tmp_path, 4, "reflow", 2,
        [
            "--training.steps=12", "--replay.sigma=0.5", "--replay.delta=2", "--weight_sync.interval=2",
            "--placement.trainer_replicate_degree=2", "--placement.trainer_shard_degree=1",
            '--placement.schedule=["4:1", "8:2"]', "--checkpoint.export_hf=true",
            "--checkpoint.enable=true", "--checkpoint.interval=4", "--checkpoint.keep_last=0",
        ],
    )
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["placement"] for r in rows] == ["T2x1+R2"] * 4 + ["T1x1+R3"] * 4 + ["T2x1+R2"] * 4
    for r in rows:  # the staleness bound, exactly
        assert len(r["staleness_counts"]) == 3 and sum(r["staleness_counts"]) == r["fresh_samples"] + r["replayed_samples"]
        assert r["fresh_samples"] >= 8  # >= b (1 - sigma), b = 16, whichever placement
    assert rows[-1]["policy_version"] == 12
    changes = [json.loads(line) for line in open(os.path.join(tmp_path, "reflow", "metrics.jsonl")) if "transition" in line]
    assert [c["transition"] for c in changes] == ["T2x1+R2 -> T1x1+R3", "T1x1+R3 -> T2x1+R2"]
    assert [c["direction"] for c in changes] == ["trainer->rollout", "rollout->trainer"]
    assert changes[0]["bytes_moved"] == 0 and changes[1]["bytes_moved"] > 0  # the joining replica got its shards
    by_rank = {led["rank"]: led for led in ledgers}
    # rank 1 trained, generated, trained again: its shard went to rank 0, and it sent samples while generating
    assert collections.Counter(by_rank[1]["handed_over_unused"]) == collections.Counter(by_rank[0]["handed_in_unused"])
    assert by_rank[1]["sent"] and by_rank[1]["consumed"]
    assert {c["step"] for c in by_rank[1]["consumed"]} <= set(range(1, 5)) | set(range(9, 13))
    assert_no_sample_lost_or_duplicated(rows, ledgers)
    assert os.path.exists(os.path.join(tmp_path, "reflow", "hf_final", "model.safetensors"))

    # resume from step 4, saved by T2x1+R2 right after the schedule decided to move to 1 replica: the
    # checkpoint records the decision, so the resumed run (started as T2x1+R2) takes up T1x1+R3 before its
    # first step, as the uninterrupted run did, and the schedule's next change still happens
    checkpoints = os.path.join(tmp_path, "reflow", "checkpoint")
    resumed, resumed_ledgers = run_decoupled(
        tmp_path / "resumed", 4, "reflow", 2,
        [
            "--training.steps=10", "--replay.sigma=0.5", "--replay.delta=2", "--weight_sync.interval=2",
            "--placement.trainer_replicate_degree=2", "--placement.trainer_shard_degree=1",
            '--placement.schedule=["4:1", "8:2"]', "--checkpoint.enable=true", f"--checkpoint.folder={checkpoints}",
            "--checkpoint.load_step=4", "--checkpoint.interval=100",
        ],
    )
    assert [r["step"] for r in resumed] == [5, 6, 7, 8, 9, 10]
    assert [r["placement"] for r in resumed] == ["T1x1+R3"] * 4 + ["T2x1+R2"] * 2
    assert resumed[0]["policy_version"] == 5
    changes = [json.loads(line) for line in open(os.path.join(tmp_path, "resumed", "reflow", "metrics.jsonl"))
               if "transition" in line]
    assert [c["transition"] for c in changes] == ["T2x1+R2 -> T1x1+R3", "T1x1+R3 -> T2x1+R2"]
    assert_no_sample_lost_or_duplicated(resumed, resumed_ledgers)
