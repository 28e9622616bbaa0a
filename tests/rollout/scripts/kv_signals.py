"""KV-cache signals from a real in-process vLLM engine under KV pressure, and the admission gate's KV rule.

The engine gets a 6-block KV cache (5 usable blocks of 128 tokens on CPU). Prompts of 120 tokens fill one
block each and need a second one after 8 generated tokens, so 16 requests at once over-commit the cache:

  free     all 16 requests added at once: the scheduler runs what fits, the rest wait, running requests
           are preempted when they need a block that is not there;
  gated    the same requests, admitted in groups of 2 (one prompt per group) through ``AdmissionGate`` with
           scheduler.kv_admission (rho 0.9): a group is estimated at 2 sequences x 2 blocks (the 120-token
           prompt fills no block whole, so nothing is shared) and starts only while it fits, so nothing is
           preempted.

Writes a JSON report to argv[1].
"""

import json
import sys

from reflow.config.job_config import JobConfig
from reflow.model.recipe import load_recipe, resolve_path
from reflow.rollout.admission import AdmissionGate
from reflow.rollout.engine import Request, RolloutEngine

cfg = JobConfig()
cfg.rollout.num_kv_blocks = 6
cfg.rollout.max_num_seqs = 16
cfg.rollout.max_new_tokens = 40
cfg.scheduler.kv_admission = True
cfg.scheduler.rho = 0.9
recipe = load_recipe("tiny")
engine = RolloutEngine(cfg.rollout, recipe, resolve_path(recipe.hf_checkpoint), seed=0)
scheduler = engine.signal_reader.scheduler
report = {"budget": engine.signals.kv_budget_tokens, "block_size": scheduler.block_size,
          "blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks}


def requests(tag: str, count: int) -> list[Request]:
    return [
        Request(f"{tag}{i}", [1] + [5 + (i // 2 + k) % 50 for k in range(119)], 40, seed=i, meta={"group": f"{tag}{i // 2}"})
        for i in range(count)
    ]


# free: everything at once
for req in requests("free", 16):
    engine.add(req)
usage, waiting, done = [], [], 0
while engine.num_active:
    done += len(engine.step())
    usage.append(engine.signals.kv_usage)
    waiting.append(engine.signals.waiting)
report["free"] = {"max_usage": max(usage), "max_waiting": max(waiting), "preemptions": engine.signals.preemptions,
                  "finished": done}

# gated: groups of 2 through the KV rule
gate = AdmissionGate(cfg.scheduler, cfg.rollout, engine, group_size=2)
start = engine.signals.preemptions
pending = requests("gated", 16)
done, max_in_flight = 0, 0
while pending or engine.num_active:
    while pending and gate.allows(len(pending[0].prompt_ids)):
        for req in pending[:2]:
            engine.add(req)
        pending = pending[2:]
    max_in_flight = max(max_in_flight, engine.num_active)
    sequences = engine.num_active
    finished = engine.step()
    gate.after_step([len(r.output_ids) for r in finished], sequences)
    done += len(finished)
window = gate.report()
report["gated"] = {
    "preemptions": engine.signals.preemptions - start, "finished": done, "max_in_flight": max_in_flight,
    "admitted_groups": window.admitted_groups, "gate_refusals": window.gate_refusals,
}
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
