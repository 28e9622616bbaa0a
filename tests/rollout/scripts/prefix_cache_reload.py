"""A weight reload must not leave KV computed by the old weights in vLLM's prefix cache.

    python tests/rollout/scripts/prefix_cache_reload.py fresh  OUT.json NEW_HF_DIR
    python tests/rollout/scripts/prefix_cache_reload.py reload OUT.json NEW_HF_DIR [--keep-prefix-cache]

``fresh`` builds an engine on the new weights and samples the probe prompt (two full KV blocks of 32 tokens and a
tail); ``reload`` builds one on the old weights, serves the probe prompt (its full blocks enter the prefix
cache), loads the new weights through ``RolloutEngine.load_weights`` and samples the probe prompt again with the
same seed. Both write the sampled tokens and their log-probs; the test compares them. ``--keep-prefix-cache``
turns the reset off (what vLLM's reload_weights alone does), so the test can show that it then fails.
"""

import json
import os
import sys

from safetensors.torch import load_file

from reflow.config.job_config import JobConfig
from reflow.model.recipe import load_recipe, resolve_path
from reflow.rollout.engine import Request, RolloutEngine
from reflow.rollout.tokenizer import PromptTokenizer

BLOCK = 32  # the CPU attention backend takes multiples of 32
PROBE = "3+5+2+8+1+9+4+7+6+2+3+5+1+1+8+9+4+4+2+7+3+3+6+1+8+2+4+9+5+5+7+3+2+6+1+4+8+2="  # BOS + 77: 2 full blocks, a tail


def probe(engine: RolloutEngine, tok: PromptTokenizer, tag: str) -> dict:
    ids = tok.encode(PROBE)
    assert len(ids) >= 2 * BLOCK, len(ids)
    req = Request(f"probe-{tag}", ids, 12, seed=4321)
    (done,) = engine.generate([req])
    return {"prompt_tokens": len(ids), "tokens": done.output_ids, "logprobs": done.logprobs}


def main() -> None:
    what, out, new_hf = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = JobConfig()
    cfg.rollout.kv_block_size = BLOCK
    cfg.rollout.temperature = 1.0
    recipe = load_recipe("tiny")
    old_hf = resolve_path(recipe.hf_checkpoint)
    engine = RolloutEngine(cfg.rollout, recipe, new_hf if what == "fresh" else old_hf, seed=0)
    tok = PromptTokenizer(old_hf)
    report = {"prefix_caching": bool(engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)}
    if what == "reload":
        if "--keep-prefix-cache" in sys.argv:
            engine.llm.reset_prefix_cache = lambda *args, **kwargs: True
        report["before"] = probe(engine, tok, "old")  # the probe's full blocks are now cached, from the old weights
        engine.load_weights(iter(load_file(os.path.join(new_hf, "model.safetensors")).items()), version=1)
    report["after"] = probe(engine, tok, "new")
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
