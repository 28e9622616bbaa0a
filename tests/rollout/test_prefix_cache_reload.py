"""After a weight reload the engine decodes over KV of the new weights, never over cached blocks of the old ones.

The probe prompt has two full KV blocks (32 tokens each, the CPU backend's smallest) and a tail; an engine that served it
holds those
blocks in its prefix cache. The new weights are the tool-use variant's (same architecture, other values)."""

import json
import os

from tests.conftest import ROOT, run_torchrun

SCRIPT = "tests/rollout/scripts/prefix_cache_reload.py"
NEW_WEIGHTS = os.path.join(ROOT, "assets", "tiny-qwen3-tools")


def _probe(tmp_path, what: str, *flags: str) -> dict:
    out = tmp_path / f"{what}{''.join(flags)}.json"
    run_torchrun(1, [SCRIPT, what, str(out), NEW_WEIGHTS, *flags])
    return json.loads(out.read_text())


def _max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_reload_resets_the_prefix_cache(tmp_path):
    fresh = _probe(tmp_path, "fresh")["after"]
    reloaded = _probe(tmp_path, "reload")
    stale = _probe(tmp_path, "reload", "--keep-prefix-cache")
    assert reloaded["prefix_caching"], "the probe needs vLLM's prefix caching on (its default)"
    assert fresh["prompt_tokens"] >= 64
    # the same seed over the same weights and the same (recomputed) KV: the same tokens, the same log-probs
    # (one float32 CPU engine against another: rounding only)
    after = reloaded["after"]
    assert after["tokens"] == fresh["tokens"]
    assert _max_gap(after["logprobs"], fresh["logprobs"]) < 1e-4, (after["logprobs"], fresh["logprobs"])
    # without the reset the probe decodes over its two cached blocks of old-weight KV: it is another distribution
    # (this is what the test catches if the reset goes missing)
    kept = stale["after"]
    assert kept["tokens"] != fresh["tokens"] or _max_gap(kept["logprobs"], fresh["logprobs"]) > 1e-2
