"""Every rank's ledger of a decoupled run: where each sample went, for the tests that prove none was lost.

One JSON file per rank (``ledger/rank{N}.json`` under the dump folder). A rank's ledger covers every role it
had over the run: a rank that generated and then trained has both sides' entries.

  trainer side  received, consumed (uid, step, staleness, head lag, response length), steps (their train
                times), evicted_unused with eviction_causes, evicted_replayable (a count), moved_out and
                moved_in (between shards), handed_over_unused and handed_in_unused (placement changes),
                left_unused and left_replayable (at the end), restored (from a checkpoint), transitions
  rollout side  started, sent (uid, destination rank, admission and finish times, response length, finish
                version), dropped_at_stop, handed_out and handed_in (request ids of the partial rollouts a
                placement change moved from one rollout worker to another, or kept on the same one)
"""

from __future__ import annotations

import json
import os

FILTERED = "no_signal"
"""The eviction cause of the samples dynamic sampling filtered: not staleness waste, since no rule could have
trained them (their group carried no gradient)."""


def filtered_uids(evicted_unused: list[str], causes: dict[str, str]) -> list[str]:
    """Of ``evicted_unused``, the samples dynamic sampling filtered (the others were evicted for staleness)."""
    return [uid for uid in evicted_unused if causes.get(uid) == FILTERED]


EVICTION_CAUSES = ("arrived_stale", "aged", "at_sync", FILTERED)
"""Why an unused sample was evicted: it was already past its bound when it arrived; it aged past it in the
buffer while the trainer waited or stepped; it was found past it at a weight sync; or its group's rewards were
all equal (dynamic sampling, reward.dynamic_sampling: dropped on arrival, never buffered)."""

ROLLOUT_KEYS = ("started", "sent", "dropped_at_stop", "handed_in", "handed_out")


def new_ledger() -> dict:
    return {
        "received": [], "consumed": [], "steps": [], "evicted_unused": [], "evicted_replayable": 0,
        "eviction_causes": {}, "moved_out": [], "moved_in": [],
        "handed_over_unused": [], "handed_in_unused": [], "left_unused": [], "left_replayable": 0, "transitions": [],
        "restored": [], **{key: [] for key in ROLLOUT_KEYS},
    }


def merge_rollout_ledger(ledger: dict, worker_ledger: dict) -> None:
    """A rollout worker's entries for one placement, into its rank's ledger."""
    for key in ROLLOUT_KEYS:
        ledger[key].extend(worker_ledger[key])


def write_ledger(ledger: dict, dump_folder: str, rank: int, trainer: bool) -> None:
    path = os.path.join(dump_folder, "ledger", f"rank{rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"rank": rank, "trainer": trainer, **ledger}, f)
