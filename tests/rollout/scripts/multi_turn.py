"""Multi-turn trajectories on one real vLLM engine (``reflow.rollout.turns.TurnDriver``).

A scripted environment answers "[ok]" at each "," the model writes (chain_sum's running sums are comma
separated), up to 2 answers per trajectory; on the prompt marked slow it takes 0.5 s. Checked:
  - the engine keeps stepping the other trajectories while the slow one waits on its environment;
  - a weight sync in the middle (hold_all, reload as version 1, resume): trajectories in the engine keep
    their turns, those waiting on a tool stay waiting and go on under version 1;
  - each trajectory's layout: model spans around the environment's "[ok]" tokens, one log-prob and version
    per model token, tool calls and tool time counted, and its reward computed by the driver;
  - the packed batch masks exactly the model's tokens, and a Hugging Face forward of the packed rows (the
    same weights) gives vLLM's behavior log-probs at the masked positions: environment tokens are context,
    never targets, and everything lines up.
Writes a JSON report to argv[1].
"""

import json
import os
import sys
import time

import torch
from safetensors.torch import load_file

from reflow.config.job_config import JobConfig
from reflow.model.recipe import load_recipe, resolve_path
from reflow.rollout.engine import Request, RolloutEngine
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.rollout.turns import TurnDriver
from reflow.tasks.base import Problem
from reflow.trainer.batch import to_batch
from reflow.types import Sample


class ScriptedEnvironment:
    stop = (",",)
    max_turns = 2

    def respond(self, problem: Problem, transcript: str) -> str | None:
        assert transcript.endswith(","), transcript
        if problem.uid == "slow":
            time.sleep(0.5)
        return "[ok]"


class ScriptedTask:
    name = "scripted"
    environment = ScriptedEnvironment()

    def format_prompt(self, problem: Problem) -> str:
        return problem.prompt

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion.count("[ok]"))


cfg = JobConfig()
recipe = load_recipe("tiny")
hf = resolve_path(recipe.hf_checkpoint)
engine = RolloutEngine(cfg.rollout, recipe, hf, seed=0)
tok = PromptTokenizer(hf)
driver = TurnDriver(engine, ScriptedTask(), tok, workers=4)
prompts = ["3+5+2+8+1+9+4+7=", "9+9+9+9+9+9+9+9+9=", "1+2+3+4+5+6+7+8+9+1=", "7+1+2+6+3+3+8=", "4+4+1+5+9+2+6+5+3="] * 2
requests = []
for i, text in enumerate(prompts):
    problem = Problem("slow" if i == 0 else f"p{i}", text, "")
    requests.append(Request(f"r{i}", tok.encode(text), 48, seed=100 + i, meta={"problem": problem}))
for req in requests:
    driver.add(req)

steps_while_slow_waits = 0
synced = False
waiting_at_sync: list[str] = []
finished: dict[str, Request] = {}
while driver.num_active:
    slow_waiting = any(r.request_id == "r0" for r in driver.waiting.values())
    engine_had_work = engine.num_active > 0
    for req in driver.step():
        finished[req.request_id] = req
    if slow_waiting and engine_had_work:
        steps_while_slow_waits += 1
    if not synced and driver.num_waiting_on_tools and engine.num_active:
        # a weight sync with trajectories both in the engine and waiting on a tool
        for req in driver.step_until_started()[0]:
            finished[req.request_id] = req
        held = driver.hold_all()
        waiting_at_sync = sorted(r.request_id for r in driver.waiting.values())
        engine.load_weights(iter(load_file(os.path.join(hf, "model.safetensors")).items()), version=1)
        driver.resume(held)
        synced = True

layouts_ok, env_text_ok, counts_ok = True, True, True
samples = []
for req in finished.values():
    spans = req.model_spans
    model_tokens = sum(end - start for start, end in spans)
    layouts_ok &= len(req.logprobs) == len(req.versions) == model_tokens
    layouts_ok &= all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # environment tokens between model turns
    gaps = [req.output_ids[a[1]:b[0]] for a, b in zip(spans, spans[1:])]
    env_text_ok &= all(tok.decode(gap) == "[ok]" for gap in gaps)
    counts_ok &= req.tool_calls >= len(gaps) and (req.tool_calls == 0 or req.tool_s > 0)
    counts_ok &= req.reward == len(gaps)  # scored by the driver, on its threads
    samples.append(Sample(
        uid=req.request_id, draw=0, group_id=req.request_id, prompt_ids=req.prompt_ids, output_ids=req.output_ids,
        logprobs=req.logprobs, versions=req.versions, reward=0.0, model_spans=spans,
    ))
batch = to_batch(samples, tok.pad_id)
mask_ok = all(
    batch.loss_mask[i].sum().item() == len(s.logprobs)
    and all(batch.loss_mask[i, len(s.prompt_ids) - 1 + j].item() == 1.0
            for start, end in s.model_spans for j in range(start, end))
    for i, s in enumerate(samples)
)

from transformers import Qwen3ForCausalLM  # noqa: E402

model = Qwen3ForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=batch.tokens).logits[:, :-1].float() / cfg.rollout.temperature
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
gap = ((logprobs - batch.behavior_logprobs).abs() * batch.loss_mask).sum() / batch.loss_mask.sum()
slow = finished["r0"]
report = {
    "finished": len(finished),
    "multi_turn": sum(1 for r in finished.values() if len(r.model_spans) > 1),
    "max_tool_calls": max(r.tool_calls for r in finished.values()),
    "steps_while_slow_waits": steps_while_slow_waits,
    "slow_tool_s": slow.tool_s,
    "waiting_at_sync": waiting_at_sync,
    "versions_after_wait": sorted({v for r in finished.values() if r.request_id in waiting_at_sync for v in r.versions}),
    "layouts_ok": bool(layouts_ok),
    "env_text_ok": bool(env_text_ok),
    "counts_ok": bool(counts_ok),
    "mask_ok": bool(mask_ok),
    "env_tokens": int(sum(len(r.output_ids) for r in finished.values()) - batch.loss_mask.sum().item()),
    "logprob_gap_mean": gap.item(),
}
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
print(report)
