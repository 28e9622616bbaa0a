"""The timeline: spans of one name close together draw as one, the rank's role changes are marked, and the merge
gives one Chrome trace with a named row per rank, times from the earliest span."""

import json

from reflow.metrics.timeline import MERGE_GAP_S, Timeline, main, merge


def test_spans_merge_and_ranks_merge_into_one_chrome_trace(tmp_path):
    trainer = Timeline(str(tmp_path), 0, "trainer")
    trainer.add("train", 100.0, 101.0)
    trainer.add("sync", 101.0, 101.5, version=1)
    trainer.close()
    rollout = Timeline(str(tmp_path), 1, "rollout")
    for k in range(100):  # a hundred engine steps back to back: one band
        rollout.add("generate", 100.2 + k * 0.01, 100.2 + k * 0.01 + 0.01 - MERGE_GAP_S / 2)
    rollout.add("idle", 101.2, 101.3)
    rollout.add("generate", 101.3 + 2 * MERGE_GAP_S, 101.4)  # after another span: a band of its own
    rollout.role("trainer")
    rollout.close()
    trace = json.loads(open(merge(str(tmp_path))).read())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert names == {0: "rank 0 (trainer)", 1: "rank 1 (rollout)"}
    spans = [(e["pid"], e["name"], e["ts"], e["dur"]) for e in trace if e["ph"] == "X"]
    expected = [(0, "train", 0, 1_000_000), (1, "generate", 200_000, 999_000), (0, "sync", 1_000_000, 500_000),
                (1, "idle", 1_200_000, 100_000), (1, "generate", 1_304_000, 96_000)]
    assert [span[:3] for span in spans] == [span[:3] for span in expected]
    # microseconds of float seconds: within one of the exact figure
    assert all(abs(span[3] - want[3]) <= 1 for span, want in zip(spans, expected)), spans
    assert [e["name"] for e in trace if e["ph"] == "i"] == ["role: trainer"]
    sync = next(e for e in trace if e["name"] == "sync")
    assert sync["args"] == {"version": 1}


def test_the_command_names_a_folder_without_a_timeline(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no timeline/rank*.jsonl" in capsys.readouterr().err
