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
    # the token slots of the passes: 8 rows of 10 tokens in one update, or in two of 4 rows
    assert rep["1"]["pass_tokens"] == rep["2"]["pass_tokens"] == 80
    # rows of 6, 13, 7 and 10 tokens, two a pass: 2 x 7 + 2 x 13, each pass padded to its longest row
    assert rep["uneven_pass_tokens"] == rep["uneven_row"] == 2 * 7 + 2 * 13
