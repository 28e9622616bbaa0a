"""A request held across a weight sync resumes from its prefix (tokens, log-probs, versions); one left in the
engine across a reload in place (a weight sync) does the same, prefilled again where it held KV."""

import json

from tests.conftest import run_torchrun


def test_partial_rollout_continuity(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(1, ["tests/rollout/scripts/partial_rollout.py", str(out)])
    rep = json.loads(out.read_text())
    assert rep["num"] == 4 and rep["held"] == 4
    assert all(n == 4 for n in rep["prefix_lens"].values())  # four engine steps, one token each
    assert rep["prefix_kept_b"] and rep["prefix_kept_c"], rep
    assert rep["num_identical"] >= 2, rep  # same weights, near-greedy: resuming changes (almost) nothing
    assert rep["logprob_gap_mean"] < 1e-2, rep
    assert rep["versions_ok"] and rep["one_logprob_per_token"]
    # D: the reload in place preempted exactly the four requests holding KV, not the two queued
    assert rep["holding_kv"] == [f"d{i}" for i in range(4)], rep
    assert rep["prefix_kept_d"] and rep["versions_d_ok"], rep
    assert rep["num_identical_d"] >= 2 and rep["logprob_gap_mean_d"] < 1e-2, rep
    assert rep["num_queued_finished"] == 2 and rep["versions_queued"] == [2], rep
    assert rep["reload_preemptions_counted"] == 0, rep
    # C's prefix was generated after D's reload (version 2), its continuation after C's (version 3)
    assert rep["versions_c"] == [2, 3]
