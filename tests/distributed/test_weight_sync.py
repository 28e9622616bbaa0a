"""vLLM and the trainer agree on log-probs after a real broadcast weight sync (3 ranks under torchrun)."""

import json

from tests.conftest import run_torchrun

# fp32 on both sides; vLLM's CPU kernels and torch's differ by rounding only
LOGPROB_TOLERANCE = 1e-3


def test_trainer_and_vllm_logprobs_agree_after_sync(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(3, ["tests/distributed/scripts/weight_sync_logprobs.py", str(out)])
    rep = json.loads(out.read_text())
    assert rep["buckets"] > 1
    assert rep["gather_full_equal"] and rep["gather_full_tensors"] > 20
    assert rep["num_tokens"] > 50
    assert rep["versions"] == [1]
    assert rep["max_abs_diff"] < LOGPROB_TOLERANCE, rep
    # the update moved the policy far more than the tolerance, so agreement is not an accident
    assert rep["change_vs_old_weights"] > 20 * LOGPROB_TOLERANCE, rep
