"""The engine's KV signals come from vLLM internals (reflow.rollout.kv_signals): this fails loudly if a vLLM
upgrade moves them, and shows the admission gate's KV rule preventing the preemptions it is meant to."""

import json

from tests.conftest import run_torchrun


def test_kv_signals_under_pressure_and_the_kv_rule_prevents_preemption(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(1, ["tests/rollout/scripts/kv_signals.py", str(out)])
    rep = json.loads(out.read_text())
    assert rep["blocks"] == 6 and rep["budget"] == 5 * rep["block_size"]  # the null block holds nothing
    free, gated = rep["free"], rep["gated"]
    assert free["finished"] == 16 and gated["finished"] == 16
    # over-committed: the cache fills, requests wait, and running ones lose their blocks
    assert free["max_usage"] >= 0.8 and free["max_waiting"] > 0 and free["preemptions"] > 0, free
    # the KV rule: every group started within rho x budget of predicted tokens, none was preempted
    assert gated["preemptions"] == 0, gated
    assert gated["admitted_groups"] == 8 and gated["gate_refusals"] > 0, gated
    assert gated["max_in_flight"] < 16
