"""What the decoupled-mode tests share: a tiny run under torchrun with its rows and ledgers, and the ledger
check that no sample is lost or duplicated."""

import collections
import glob
import json
import os

import pytest

from tests.conftest import run_torchrun

DECOUPLED_KEYS = {
    "trainer_idle_ratio", "rollout_idle_ratio", "replay_fraction", "alpha", "staleness_max", "staleness_counts",
    "fresh_samples", "replayed_samples", "mode", "reward_mean", "tokens_per_s", "trainer_wait_ratio",
    "sync_stall_ratio", "loss_tokens", "loss_tokens_per_s", "fresh_samples_per_s", "masked_token_frac",
}


def run_decoupled(tmp_path, nproc, mode, rollout_ranks, extra=()):
    """A tiny run of ``mode`` under torchrun; its step rows (each checked for the decoupled keys and the idle,
    loss-token and fresh-rate identities) and every rank's ledger."""
    dump = str(tmp_path / mode)
    run_torchrun(
        nproc,
        [
            "-m", "reflow.train", "--config", "train_configs/tiny.toml",
            f"--job.dump_folder={dump}", f"--training.mode={mode}", f"--placement.num_rollout_ranks={rollout_ranks}",
            "--training.prompts_per_step=4", "--training.group_size=4", "--rollout.max_new_tokens=24",
            "--metrics.enable_progress_bar=false", "--checkpoint.export_hf=false", *extra,
        ],
    )
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    # placement changes, placement decisions and the final policy's evaluation have rows of their own
    rows = [row for row in rows if "transition" not in row and "planner_reason" not in row and "loss" in row]
    ledgers = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(dump, "ledger", "rank*.json")))]
    for row in rows:
        assert DECOUPLED_KEYS <= set(row), DECOUPLED_KEYS - set(row)
        # the trainer idles while it waits for data and while it stalls in a weight sync, and only then
        assert row["trainer_idle_ratio"] == pytest.approx(row["trainer_wait_ratio"] + row["sync_stall_ratio"], abs=1e-9)
        assert row["sync_stall_ratio"] > 0 or row["weight_sync_s"] == 0
        # tokens carrying loss weight: at most the trained tokens (prompts carry none, a replayed row counts at tau)
        assert 0 < row["loss_tokens"] < row["trainer_tokens"]
        assert row["fresh_samples_per_s"] == pytest.approx(row["fresh_samples"] / row["step_time_s"], rel=1e-9)
    return rows, ledgers


def assert_no_sample_lost_or_duplicated(rows, ledgers):
    """Every request a rank started (or resumed, handed over at a placement change) was sent, handed over, or was
    unfinished at the stop; every partial rollout handed over was resumed once; every group sent reaches the shard
    it was bound to when it finished, once; a sample moved between shards leaves one and reaches the other; a
    shard that leaves the trainer pool hands each unused sample to one staying shard; and every sample sent (or restored
    unused from a checkpoint) is trained fresh exactly once, evicted
    unused, or still unused at the end.
    The metrics count exactly the samples consumed. (Every rank's ledger covers all the roles it had.)"""
    for led in ledgers:  # a partial rollout handed over at a placement change is sent by the worker that resumed it
        accounted = [e["uid"] for e in led["sent"]] + led["dropped_at_stop"] + led["handed_out"]
        assert collections.Counter(accounted) == collections.Counter(led["started"] + led["handed_in"]), led["rank"]
    handed_out = collections.Counter(u for led in ledgers for u in led["handed_out"])
    assert handed_out == collections.Counter(u for led in ledgers for u in led["handed_in"])
    sent = [e["uid"] for led in ledgers for e in led["sent"]]
    assert sent and len(set(sent)) == len(sent)
    received = [u for led in ledgers for u in led["received"]]
    assert collections.Counter(received) == collections.Counter(sent)
    routed = {e["uid"]: e["to"] for led in ledgers for e in led["sent"]}
    for led in ledgers:
        assert all(routed[u] == led["rank"] for u in led["received"])
    handed_over = collections.Counter(u for led in ledgers for u in led["handed_over_unused"])
    assert handed_over == collections.Counter(u for led in ledgers for u in led["handed_in_unused"])
    moved_out = collections.Counter(u for led in ledgers for u in led["moved_out"])  # a short shard took a surplus
    assert moved_out == collections.Counter(u for led in ledgers for u in led["moved_in"])
    consumed = [c["uid"] for led in ledgers for c in led["consumed"]]
    assert len(consumed) == len(set(consumed))  # a sample is fresh once, on one shard
    fate = consumed + [u for led in ledgers for u in led["evicted_unused"] + led["left_unused"]]
    # a resumed run also owes a fate to the unused samples its checkpoint's buffers held
    restored_unused = [r["uid"] for led in ledgers for r in led.get("restored", []) if r["use_count"] == 0]
    assert collections.Counter(fate) == collections.Counter(sent + restored_unused)
    assert sum(r["fresh_samples"] for r in rows) == len(consumed)
