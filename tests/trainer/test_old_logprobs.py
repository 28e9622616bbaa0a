"""The PPO "old" log-probs: scored by a separate forward only when a batch gets more than one update."""

import json

from tests.conftest import run_torchrun


def test_one_update_per_batch_runs_no_separate_old_logprob_forward(tmp_path):
    """With ppo_epochs = num_minibatches = 1 the old log-probs are the new ones, detached: one forward per
    micro-batch, and the PPO ratio is exactly 1 (nothing clipped). Two minibatches still score them first."""
    out = tmp_path / "report.json"
    run_torchrun(1, ["tests/trainer/scripts/forward_count.py", str(out)])
    rep = json.loads(out.read_text())
    assert rep["1"]["forwards"] == 1 and rep["1"]["clip_fraction"] == 0.0
    assert rep["2"]["forwards"] == 1 + 2
