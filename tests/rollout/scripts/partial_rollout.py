"""Partial rollout continuity on one real vLLM engine.

A: requests run uninterrupted (near-greedy sampling, fixed seeds).
B: the same requests are held after a few engine steps (hold_all), the weights are reloaded (same values,
   as a sync would), the held requests are re-added and finish.
Resuming recomputes the prefix's KV cache by prefill instead of decode, so near-ties may flip: B must
keep every held prefix exactly and match A closely (most outputs identical, log-probs within rounding
where the tokens agree); each token keeps the version that produced it (0 before, 1 after), and
there is one log-prob per token. D: a reload in place (a weight sync) under four requests holding KV and two
queued: the four are preempted by the reload and prefill again, and must match A as closely as B does, each
token labelled with its version; the queued two start under the new version; the reload's preemptions are not
counted as KV pressure. Then C: a hold across a reload with *different* weights changes the continuation but
keeps the prefix. Writes a JSON report to argv[1].
"""

import json
import os
import sys

from safetensors.torch import load_file

from reflow.config.job_config import JobConfig
from reflow.model.recipe import load_recipe, resolve_path
from reflow.rollout.engine import Request, RolloutEngine
from reflow.rollout.tokenizer import PromptTokenizer

cfg = JobConfig()
cfg.rollout.temperature = 1e-3  # near-greedy: the uninterrupted and resumed runs must agree exactly
recipe = load_recipe("tiny")
hf = resolve_path(recipe.hf_checkpoint)
engine = RolloutEngine(cfg.rollout, recipe, hf, seed=0)
tok = PromptTokenizer(hf)
prompts = ["3+5+2+8+1+9+4+7=", "9+9+9+9+9+9+9+9+9=", "1+2+3+4+5+6+7+8+9+1=", "7+1+2+6+3+3+8="]


def requests(tag):
    return [Request(f"{tag}{i}", tok.encode(p), 40, seed=100 + i) for i, p in enumerate(prompts)]


a = {r.request_id[1:]: r for r in engine.generate(requests("a"))}

weights = list(load_file(os.path.join(hf, "model.safetensors")).items())
for r in requests("b"):
    engine.add(r)
for _ in range(4):
    engine.step()
held = engine.hold_all()
prefix_lens = {r.request_id[1:]: len(r.output_ids) for r in held}
prefix_b = {r.request_id[1:]: list(r.output_ids) for r in held}
engine.load_weights(iter(weights), version=1)
for r in held:
    engine.add(r)
b = {}
while engine.num_active:
    for r in engine.step():
        b[r.request_id[1:]] = r

# D: a reload in place (a weight sync): nothing taken out. The four requests holding KV are preempted by the
# reload and prefill their prefix again; two queued ones (added after the last step, never scheduled) wait on
for r in requests("d"):
    engine.add(r)
for _ in range(4):
    engine.step()
queued = [Request(f"q{i}", tok.encode(p), 40, seed=200 + i) for i, p in enumerate(prompts[:2])]
for r in queued:
    engine.add(r)
holding = sorted(r.request_id for r in engine.holding_kv())
prefix_d = {r.request_id[1:]: list(r.output_ids) for r in engine.active.values() if r.request_id.startswith("d")}
preemptions_before = engine.signals.preemptions
engine.load_weights(iter(weights), version=2)
d, q = {}, {}
while engine.num_active:
    for r in engine.step():
        (d if r.request_id.startswith("d") else q)[r.request_id[1:]] = r
preemptions_after = engine.signals.preemptions

# C: different weights after the hold
for r in requests("c"):
    engine.add(r)
for _ in range(3):
    engine.step()
held_c = engine.hold_all()
prefix_c = {r.request_id: list(r.output_ids) for r in held_c}
engine.load_weights(iter([(k, v * 0.5 if "lm_head" in k else v) for k, v in weights]), version=3)
for r in held_c:
    engine.add(r)
c = {}
while engine.num_active:
    for r in engine.step():
        c[r.request_id] = r

def _mean_gap(a, b):
    gaps = []
    for k in a:
        for x, y, tx, ty in zip(a[k].logprobs, b[k].logprobs, a[k].output_ids, b[k].output_ids):
            if tx != ty:
                break
            gaps.append(abs(x - y))
    return sum(gaps) / len(gaps)


report = {
    "num": len(a),
    "a": {k: tok.decode(v.output_ids) for k, v in a.items()},
    "b": {k: tok.decode(v.output_ids) for k, v in b.items()},
    "held": len(held),
    "num_identical": sum(a[k].output_ids == b[k].output_ids for k in a),
    "prefix_kept_b": all(b[k].output_ids[: len(v)] == v for k, v in prefix_b.items()),
    "prefix_lens": prefix_lens,
    "versions_ok": all(b[k].versions == [0] * prefix_lens[k] + [1] * (len(b[k].output_ids) - prefix_lens[k]) for k in b),
    "one_logprob_per_token": all(len(r.logprobs) == len(r.output_ids) == len(r.versions)
                                 for r in [*b.values(), *c.values(), *d.values(), *q.values()]),
    # log-probs along the stretch where the two runs chose the same tokens
    "logprob_gap_mean": _mean_gap(a, b),
    "holding_kv": holding,
    "num_identical_d": sum(a[k].output_ids == d[k].output_ids for k in a),
    "logprob_gap_mean_d": _mean_gap(a, d),
    "prefix_kept_d": all(d[k].output_ids[: len(v)] == v for k, v in prefix_d.items()),
    "versions_d_ok": all(d[k].versions == [1] * 4 + [2] * (len(d[k].output_ids) - 4) for k in d),
    "versions_queued": sorted({v for r in q.values() for v in r.versions}),
    "num_queued_finished": len(q),
    "reload_preemptions_counted": preemptions_after - preemptions_before,
    "prefix_kept_c": all(c[k].output_ids[: len(p)] == p for k, p in prefix_c.items()),
    "versions_c": sorted({v for r in c.values() for v in r.versions}),
}
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
