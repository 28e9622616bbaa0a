"""A LoRA run's engine (``RolloutEngine`` with ``AdapterSlots``) on the tiny model: requests finish on the adapter
version they started on. Writes a JSON report to argv[1].

A: requests run start to end on the base (version 0), with nothing else happening.
B: the same requests (same seeds) start on the base; after a few steps an adapter of version 1 is loaded
   (a peft folder with B != 0) and new requests start; the first ones go on, never held or resubmitted, and
   end exactly as in A (the same tokens and log-probs, every token labelled 0); the new ones are labelled 1
   and sample under the adapter (their first log-probs differ from the base's on the same prompt and seed).
C: version 1's adapter as vLLM applies it, against peft applying the same folder (prompt log-probs).
Then versions 2 and 3: the engine keeps the newest 2 (AdapterSlots.versions) and drops older ones no request
uses.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from reflow.config.job_config import JobConfig
from reflow.model.recipe import load_recipe, resolve_path
from reflow.rollout.engine import AdapterSlots, Request, RolloutEngine
from reflow.rollout.tokenizer import PromptTokenizer

RANK = 8
out_dir = os.path.dirname(os.path.abspath(sys.argv[1]))
cfg = JobConfig()
recipe = load_recipe("tiny")
hf = resolve_path(recipe.hf_checkpoint)
engine = RolloutEngine(cfg.rollout, recipe, hf, seed=0, adapters=AdapterSlots(RANK, 2))
tok = PromptTokenizer(hf)
prompts = ["3+5+2+8+1+9+4+7=", "9+9+9+9+9+9+9+9+9=", "1+2+3+4+5+6+7+8+9+1=", "7+1+2+6+3+3+8="]
arch = recipe.architecture


def adapter_folder(version: int) -> str:
    """A peft folder for the tiny model: random A and B on q_proj and v_proj of every layer."""
    g = torch.Generator().manual_seed(version)
    tensors = {}
    for layer in range(arch.n_layers):
        for name, out_features in (("q_proj", arch.n_heads * arch.head_dim), ("v_proj", arch.n_kv_heads * arch.head_dim)):
            module = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(RANK, arch.dim, generator=g) * 0.1
            tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, RANK, generator=g) * 0.1
    folder = os.path.join(out_dir, f"adapter-v{version}")
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16,
                   "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": hf}, f)
    return folder


def requests(tag):
    return [Request(f"{tag}{i}", tok.encode(p), 40, seed=100 + i) for i, p in enumerate(prompts)]


report = {}
a = {r.request_id[1:]: r for r in engine.generate(requests("a"))}

first = requests("b")
for req in first:
    engine.add(req)
for _ in range(3):
    engine.step()
in_flight_before = engine.num_active
report["load_s"] = engine.load_adapter(adapter_folder(1), 1)
report["in_flight_kept"] = engine.num_active == in_flight_before > 0
second = requests("c")
for req in second:
    engine.add(req)
done = []
while engine.num_active:
    done += engine.step()
b = {r.request_id[1:]: r for r in first}
report["first_same_as_uninterrupted"] = all(a[k].output_ids == b[k].output_ids and a[k].logprobs == b[k].logprobs
                                            for k in a)
report["first_versions"] = sorted({v for r in first for v in r.versions})
report["second_versions"] = sorted({v for r in second for v in r.versions})
report["second_first_logprob_moved"] = sum(abs(r.logprobs[0] - a[r.request_id[1:]].logprobs[0]) > 1e-3 for r in second)
report["second_tokens_differ"] = sum(r.output_ids != a[r.request_id[1:]].output_ids for r in second)
# version 1's adapter as vLLM applies it, against peft applying the same folder to the base (transformers): the
# prompt log-probs of one sequence
probe = a["0"].prompt_ids + a["0"].output_ids[:12]
from vllm import SamplingParams  # noqa: E402

served = engine.llm.generate([{"prompt_token_ids": probe}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                             lora_request=engine.loaded[1], use_tqdm=False)[0]
vllm_logprobs = torch.tensor([next(iter(d.values())).logprob for d in served.prompt_logprobs[1:]])
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32),
                                      adapter_folder(1)).eval()
with torch.no_grad():
    ids = torch.tensor([probe])
    peft_logprobs = torch.log_softmax(reference(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
report["vllm_vs_peft_max_diff"] = float((vllm_logprobs - peft_logprobs).abs().max())
base_logprobs = torch.tensor(a["0"].logprobs[:12])
report["adapter_moves_logprobs"] = float((peft_logprobs[-12:] - base_logprobs).abs().max())
for version in (2, 3):
    engine.load_adapter(adapter_folder(version), version)
report["loaded_after_v3"] = sorted(engine.loaded)
# a request on a version this engine no longer has (held past the versions kept, or handed over) goes on under the
# newest: its later tokens are labelled with the version that samples them
late = requests("d")[0]
late.output_ids, late.logprobs, late.versions, late.model_spans = [5], [-1.0], [1], [[0, 1]]
late.adapter_version = 1
engine.add(late)
while engine.num_active:
    engine.step()
report["repinned_to"] = late.adapter_version
report["repinned_versions"] = sorted(set(late.versions))
report["vllm_adapters_after_v3"] = sorted(engine.engine.list_loras())
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
print(json.dumps(report, indent=1))
