"""A LoRA run's engine: a request finishes on the adapter version it started on, while new requests take the
newest (``tests/rollout/scripts/adapter_versions.py`` says what each part of the report is)."""

import json

from tests.conftest import run_torchrun


def test_requests_finish_on_their_own_adapter_version(tmp_path):
    out = tmp_path / "adapters.json"
    run_torchrun(1, ["tests/rollout/scripts/adapter_versions.py", str(out)])
    rep = json.loads(out.read_text())
    # loading version 1 held nothing: the requests in flight went on, and ended exactly as without the load
    assert rep["in_flight_kept"] and rep["first_same_as_uninterrupted"]
    assert rep["first_versions"] == [0] and rep["second_versions"] == [1]  # one version per trajectory
    assert rep["second_first_logprob_moved"] == 4 and rep["second_tokens_differ"] == 4  # sampled under the adapter
    assert rep["loaded_after_v3"] == [2, 3] and rep["vllm_adapters_after_v3"] == [3, 4]  # the newest two (ids v + 1)
    assert rep["repinned_to"] == 3 and rep["repinned_versions"] == [1, 3]  # its own token, then the newest's
    # vLLM serves the folder as peft applies it (float32 both, different kernels: 1.4e-6 measured on a trained
    # adapter), and the adapter does move the model
    assert rep["vllm_vs_peft_max_diff"] < 1e-4 < rep["adapter_moves_logprobs"]

