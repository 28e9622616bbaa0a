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


def _fake_llm(requests: dict):
    """The vLLM path the reader reads (``EngineSignalReader.__init__``), over ``requests`` (id -> preemptions)."""
    from types import SimpleNamespace

    scheduler = SimpleNamespace(
        requests=requests, running=[], kv_holding_waiting=[], block_size=16,
        get_request_counts=lambda: (len(requests), 0),
        kv_cache_manager=SimpleNamespace(usage=0.5, block_pool=SimpleNamespace(num_gpu_blocks=11)),
    )
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=scheduler))))


def test_preemptions_a_reload_made_stay_excused_when_their_requests_leave_before_the_next_read():
    """A weight reload preempts the running requests on purpose (excused); one of them is then handed over or
    evicted at the sync, before the engine's next read: the count neither goes below zero nor counts the
    reload's preemptions as KV pressure, and one real preemption later counts once."""
    from types import SimpleNamespace

    from reflow.rollout.kv_signals import EngineSignalReader

    requests = {"a": SimpleNamespace(num_preemptions=0), "b": SimpleNamespace(num_preemptions=0)}
    reader = EngineSignalReader(_fake_llm(requests))
    assert reader.read().preemptions == 0 and reader.kv_budget_tokens == 160
    before = reader.held_preemptions()
    for request in requests.values():  # the reload's reset preempts both
        request.num_preemptions += 1
    reader.excuse_reload(reader.held_preemptions() - before)
    del requests["a"]  # handed over at the sync, before the next read
    assert reader.read().preemptions == 0
    requests["b"].num_preemptions += 1  # KV pressure
    assert reader.read().preemptions == 1
    del requests["b"]  # finished
    assert reader.read().preemptions == 1
