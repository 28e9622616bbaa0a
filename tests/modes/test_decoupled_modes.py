"""Decoupled modes under torchrun: each mode trains what its anchor trains, and no sample is lost or duplicated."""

import collections
import json
import os

import pytest

from tests.conftest import run_torchrun
from tests.modes.decoupled_runs import assert_no_sample_lost_or_duplicated, run_decoupled


def test_one_step_off_trains_only_samples_of_the_previous_policy(tmp_path):
    """2 trainer shards + 1 rollout rank: step 1 trains version 0's samples at version 0, and every later step
    trains only samples exactly one version old, while the current policy generates the next batch."""
    rows, ledgers = run_decoupled(tmp_path, 3, "one_step_off", 1, ["--training.steps=6"])
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[0]["staleness_counts"] == [16, 0]
    assert all(r["staleness_counts"] == [0, 16] for r in rows[1:]), [r["staleness_counts"] for r in rows]
    assert all(r["replayed_samples"] == 0 for r in rows)
    trainers = [led for led in ledgers if led["trainer"]]
    assert len(trainers) == 2
    for led in trainers:  # per shard, per sample
        assert all(c["staleness"] == (0 if c["step"] == 1 else 1) for c in led["consumed"])
        assert led["evicted_unused"] == []  # nothing was generated in vain
    assert_no_sample_lost_or_duplicated(rows, ledgers)


def test_one_step_off_resumes_without_waiting_for_a_version_that_was_never_generated(tmp_path):
    """After a resume at version 3 the engines only hold version 3: the first step trains those samples, and
    every later step trains samples exactly one version old again."""
    extra = ["--training.steps=3", "--checkpoint.enable=true", "--checkpoint.interval=3"]
    run_decoupled(tmp_path, 2, "one_step_off", 1, extra)
    rows, ledgers = run_decoupled(tmp_path, 2, "one_step_off", 1, ["--training.steps=6", "--checkpoint.enable=true"])
    resumed = [r for r in rows if r["step"] > 3]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert resumed[0]["staleness_counts"] == [16, 0]
    assert all(r["staleness_counts"] == [0, 16] for r in resumed[1:])
    assert_no_sample_lost_or_duplicated(resumed, ledgers)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """One async run for two tests: 1 trainer + 2 rollout ranks, delta 3, a sync every 2 steps, evaluating 16
    held-out prompts at every sync."""
    return run_decoupled(
        tmp_path_factory.mktemp("async"), 3, "async", 2,
        ["--training.steps=8", "--replay.delta=3", "--weight_sync.interval=2", "--metrics.eval_interval=2",
         "--metrics.eval_num_prompts=16"],
    )


def test_async_overlaps_generation_with_training_within_delta(async_run):
    """1 trainer + 2 rollout ranks, delta 3, a sync every 2 steps (steps_ahead 2): samples are consumed while
    newer ones are in flight, some trained samples come from older policies, none is staler than delta."""
    rows, ledgers = async_run
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(len(r["staleness_counts"]) == 4 and sum(r["staleness_counts"]) == 16 for r in rows)
    # generation ran ahead of the trainer: with a sync every 2 steps, staleness 2 or 3 needs a sample started
    # at least one whole sync interval before the step that trains it
    assert sum(sum(r["staleness_counts"][2:]) for r in rows) > 0
    trainer = next(led for led in ledgers if led["trainer"])
    # overlap: samples were being generated while the trainer trained, in most steps
    rollouts = [led for led in ledgers if not led["trainer"]]
    assert len(rollouts) == 2 and all(led["sent"] for led in rollouts)  # both rollout ranks generated
    sent = [e for led in rollouts for e in led["sent"]]
    overlapped = [
        s for s in trainer["steps"]
        if any(e["admitted_at"] < s["train_end"] and e["finished_at"] > s["train_start"] for e in sent)
    ]
    assert len(overlapped) >= len(rows) // 2, f"{len(overlapped)} of {len(rows)} steps overlapped generation"
    assert_no_sample_lost_or_duplicated(rows, ledgers)


def test_reflow_two_replicas_two_rollout_ranks_no_sample_lost_or_duplicated(tmp_path):
    """4 ranks: 2 trainer replicas (HSDP 2x1, a buffer shard each) fed by 2 rollout ranks, 2 minibatch updates
    per step. Every sample sent arrives at exactly one shard, once; each batch holds >= b(1 - sigma) fresh
    samples, at most b sigma replayed ones, none staler than delta; every rollout rank feeds every shard."""
    rows, ledgers = run_decoupled(
        tmp_path, 4, "reflow", 2,
        ["--training.steps=6", "--replay.sigma=0.5", "--replay.delta=3", "--weight_sync.interval=2",
         "--placement.trainer_replicate_degree=2", "--training.num_minibatches=2"],
    )
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert r["fresh_samples"] >= 8  # >= b (1 - sigma) with b = 16
        assert r["replayed_samples"] <= 8
        assert r["fresh_samples"] + r["replayed_samples"] == 16  # exactly b
        assert len(r["staleness_counts"]) == 4 and sum(r["staleness_counts"]) == r["fresh_samples"] + r["replayed_samples"]
    assert rows[-1]["policy_version"] == 6
    trainers = [led for led in ledgers if led["trainer"]]
    assert len(trainers) == 2 and all(len(t["received"]) > 0 for t in trainers)  # both shards fed
    assert all(c["staleness"] <= 3 for t in trainers for c in t["consumed"])
    rollouts = [led for led in ledgers if not led["trainer"]]
    assert all({e["to"] for e in led["sent"]} == {0, 1} for led in rollouts)  # each rollout rank feeds both shards
    assert_no_sample_lost_or_duplicated(rows, ledgers)
    # the timeline: one row per rank, the trainers training and syncing, the rollout ranks generating and syncing
    from reflow.metrics.timeline import merge

    trace = json.load(open(merge(str(tmp_path / "reflow"))))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert names == {0: "rank 0 (trainer)", 1: "rank 1 (trainer)", 2: "rank 2 (rollout)", 3: "rank 3 (rollout)"}
    did = {pid: {e["name"] for e in trace if e["ph"] == "X" and e["pid"] == pid} for pid in names}
    assert all({"train", "sync"} <= did[pid] for pid in (0, 1)), did
    assert all({"generate", "sync"} <= did[pid] for pid in (2, 3)), did


def test_time_budget_stops_all_ranks_and_exports(tmp_path):
    """training.time_budget_s ends a decoupled run early on every rank; the policy is still exported."""
    dump = str(tmp_path / "budget")
    run_torchrun(
        2,
        [
            "-m", "reflow.train", "--config", "train_configs/tiny.toml",
            f"--job.dump_folder={dump}", "--training.mode=reflow", "--placement.num_rollout_ranks=1",
            "--training.prompts_per_step=4", "--training.group_size=4", "--rollout.max_new_tokens=24",
            "--training.steps=500", "--training.time_budget_s=3", "--metrics.enable_progress_bar=false",
        ],
    )
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert 1 <= len(rows) < 500 and rows[-1]["step"] == len(rows)
    assert os.path.exists(os.path.join(dump, "hf_final", "model.safetensors"))


def test_rollout_admits_a_grant_before_a_sync_queued_behind_it(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(1, ["tests/modes/scripts/rollout_command_order.py", str(out)])
    report = json.loads(out.read_text())
    assert report["groups"] == 3 and report["started"] == 6
    assert report["birth_versions"] == [0, 0, 0], report  # the granted group started on version 0


def test_decoupled_modes_evaluate_on_the_rollout_ranks_at_weight_syncs(async_run):
    """async, 1 trainer + 2 rollout ranks, metrics.eval_interval = 2: before generating (version 0) and after the
    weight syncs to versions 2, 4, ... both rollout ranks score their half of the held-out prompts, and trainer rank 0
    logs the mean with the version it measured, without the trainer waiting for it."""
    rows, _ = async_run
    evaluated = [r for r in rows if "eval_reward" in r]
    assert evaluated, "no evaluation finished"
    versions = [r["eval_policy_version"] for r in evaluated]
    # the starting policy first (evaluated before the rollout ranks generate), then the synced versions
    assert versions == sorted(set(versions)) and versions[0] == 0 and set(versions) <= {0, 2, 4, 6, 8}
    for r in evaluated:
        assert 0.0 <= r["eval_reward"] <= 1.0
        assert r["policy_version"] >= r["eval_policy_version"]  # logged at a step after the sync it measured


def test_eval_interval_must_follow_the_weight_syncs():
    from reflow.config import ConfigError, ConfigManager
    from reflow.config.validate import validate

    manager = ConfigManager()
    cfg = manager.parse_args(["--training.mode=async", "--weight_sync.interval=2", "--metrics.eval_interval=3"])
    with pytest.raises(ConfigError, match="metrics.eval_interval.*multiple of the weight-sync interval"):
        validate(cfg, manager.where)


def test_reflow_dynamic_sampling_drops_uniform_groups_and_still_fills_each_batch(tmp_path):
    """DAPO's dynamic sampling in reflow mode with B_max = the batch (1 trainer, 1 rollout rank): groups whose
    rewards are all equal retire on arrival (eviction cause no_signal) and never train, yet every step still
    trains a full batch with its fresh share, because filtered samples give their B_max credit back; nothing
    is lost or duplicated."""
    rows, ledgers = run_decoupled(
        tmp_path, 2, "reflow", 1,
        ["--training.steps=5", "--training.prompts_per_step=8", "--reward.dynamic_sampling=true", "--replay.sigma=0.25"],
    )
    assert [r["step"] for r in rows] == list(range(1, 6))
    assert all(r["fresh_samples"] + r["replayed_samples"] == 32 and r["fresh_samples"] >= 24 for r in rows)
    filtered = sum(r["evicted_no_signal"] for r in rows)
    assert filtered > 0 and any(r["dynamic_sampling_filtered_frac"] > 0 for r in rows)
    causes = collections.Counter(cause for led in ledgers for cause in led["eviction_causes"].values())
    assert causes["no_signal"] >= filtered  # (groups that arrive after the last step's row are in the ledger only)
    no_signal = {uid for led in ledgers for uid, cause in led["eviction_causes"].items() if cause == "no_signal"}
    assert not no_signal & {c["uid"] for led in ledgers for c in led["consumed"]}  # a filtered sample never trains
    assert_no_sample_lost_or_duplicated(rows, ledgers)
