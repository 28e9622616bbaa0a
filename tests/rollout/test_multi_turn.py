"""Multi-turn trajectories through a real vLLM engine: tools off the engine's path, turns kept across a weight
sync, and the environment's tokens in context but never trained on (tests/rollout/scripts/multi_turn.py)."""

import json

from tests.conftest import run_torchrun


def test_multi_turn_trajectories(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(1, ["tests/rollout/scripts/multi_turn.py", str(out)])
    report = json.loads(out.read_text())
    assert report["finished"] == 10
    assert report["multi_turn"] >= 5 and report["max_tool_calls"] == 2, report
    # the engine went on generating for the others while the slow trajectory waited 0.5 s on its environment
    assert report["steps_while_slow_waits"] >= 3 and report["slow_tool_s"] >= 0.5, report
    # trajectories waiting on a tool at the sync stayed there and went on under the new weights (version 1)
    assert report["waiting_at_sync"] and 1 in report["versions_after_wait"], report
    assert report["layouts_ok"] and report["env_text_ok"] and report["counts_ok"] and report["mask_ok"], report
    assert report["env_tokens"] >= 4 * report["multi_turn"]
    # the trainer's view of the packed rows gives vLLM's log-probs at exactly the model's tokens
    assert report["logprob_gap_mean"] < 1e-3, report
