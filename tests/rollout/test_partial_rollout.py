"""A request held across a weight sync resumes from its prefix (tokens, log-probs, versions)."""

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
    # C's prefix was generated after B's reload (version 1), its continuation after C's (version 2)
    assert rep["versions_c"] == [1, 2]
