"""Agent episodes on one real vLLM engine through the real endpoint and the real ``openai`` client
(``reflow.serving.agents``). Writes a JSON report to argv[1]. Checked:
  - 64 episodes of the example calculator agent in flight at once (8 prompts x 8), a weight sync in the
    middle (hold, reload as version 1, resume): every trajectory's model tokens are exactly the tokens its calls
    returned, in order, one log-prob and one version per model token, versions 0 then 1 across the sync;
  - a chat agent that sends the assistant message back as it was returned, with a tool message: its chat
    prompt extends the sampled tokens exactly (no mismatch), its calls got chat shapes with log-probs;
  - an agent that raises, one that hangs past task.agent_timeout_s, one that calls past task.max_turns:
    scored failures with their causes, nothing left in the engine or the endpoint;
  - malformed calls (n = 2, another temperature, a body that is not JSON, a wrong key): OpenAI's error shape
    with a 4xx status, and the episode goes on;
  - a run stopped with turns in the engine: every turn aborted, its call refused, every agent cancelled.
The agents run in the agents' process (``reflow.serving.agent_host``, which imports this module as ``__main__``):
what they saw comes back through a JSON-lines file (``AGENT_RECORDS``).
"""

import asyncio
import json
import os
import sys
import time

import httpx
import openai
from safetensors.torch import load_file

from reflow.config.job_config import JobConfig
from reflow.examples.calculator_agent import TASK, solve
from reflow.model.recipe import load_recipe, resolve_path
from reflow.rollout.engine import RolloutEngine
from reflow.rollout.groups import make_group_requests
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.serving.drivers import AgentServing, new_driver
from reflow.tasks.agent import AgentTask
from reflow.tasks.base import Problem


def record(kind: str, value, key: str | None = None) -> None:
    """From an agent, in the agents' process: one line of what it saw."""
    with open(os.environ["AGENT_RECORDS"], "a") as f:
        f.write(json.dumps({"kind": kind, "key": key, "value": value}) + "\n")


def records() -> list[dict]:
    if not os.path.exists(os.environ["AGENT_RECORDS"]):
        return []
    with open(os.environ["AGENT_RECORDS"]) as f:
        return [json.loads(line) for line in f]


def status() -> dict[str, list]:
    """Every record but the calls' tokens, by kind."""
    out: dict[str, list] = {}
    for line in records():
        if line["kind"] != "returned":
            out.setdefault(line["kind"], []).append(line["value"])
    return out


class RecordingClient:
    """The agent's client, recording what each completion returned (token-exactness is checked against it)."""

    def __init__(self, client, key):
        self.client, self.key = client, key
        self.completions = self

    async def create(self, **kwargs):
        out = await self.client.completions.create(**kwargs)
        record("returned", list(out.choices[0].model_extra["token_ids"]), self.key)
        return out


async def recorded_calc(client, row):
    return await solve(RecordingClient(client, row["id"] + "@" + str(id(client))), row)


async def chat(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    first = await client.chat.completions.create(model=row["model"], messages=messages, tools=tools, max_tokens=12,
                                                 logprobs=True)
    reply = first.choices[0].message
    record("chat_logprobs", len(first.choices[0].logprobs.content))
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model=row["model"], messages=messages, max_tokens=12)
    record("chat_prompt_extends", second.model_extra["prompt_token_ids"][: len(first.model_extra["prompt_token_ids"])]
           == first.model_extra["prompt_token_ids"])
    return 1.0


async def raiser(client, row):
    await client.completions.create(model=row["model"], prompt=row["prompt"], max_tokens=4)
    raise RuntimeError("the agent's own bug")


async def sleeper(client, row):
    await client.completions.create(model=row["model"], prompt=row["prompt"], max_tokens=4)
    await asyncio.sleep(3600)


async def hog(client, row):
    prompt = row["prompt"]
    for _ in range(10):
        out = await client.completions.create(model=row["model"], prompt=prompt, max_tokens=2)
        prompt += out.choices[0].text
    return 1.0


async def malformed(client, row):
    codes = []
    for bad in ({"n": 2}, {"temperature": 0.3}):
        try:
            await client.completions.create(model=row["model"], prompt=row["prompt"], max_tokens=4, **bad)
        except openai.APIStatusError as error:
            codes.append([error.status_code, error.body.get("param") if isinstance(error.body, dict) else None])
    url = str(client.base_url) + "completions"
    async with httpx.AsyncClient() as raw:
        answer = await raw.post(url, content=b"{not json", headers={"Authorization": f"Bearer {client.api_key}",
                                                                    "Content-Type": "application/json"})
        codes.append([answer.status_code, sorted(answer.json()["error"])])
        answer = await raw.post(url, json={"model": row["model"], "prompt": "1"}, headers={"Authorization": "Bearer no"})
        codes.append([answer.status_code, answer.json()["error"]["code"]])
    record("malformed", codes)
    out = await client.completions.create(model=row["model"], prompt=row["prompt"], max_tokens=4)  # it goes on
    return float(len(out.choices[0].token_ids) > 0)


async def long_call(client, row):
    try:
        await client.completions.create(model=row["model"], prompt=row["prompt"], max_tokens=100)
    except openai.APIStatusError as error:  # the call refused (503), if the answer beats the cancellation
        record("dropped", error.status_code)
        raise
    except asyncio.CancelledError:  # the agent cancelled while it waits
        record("dropped", "cancelled")
        raise
    return 1.0


def main():
    os.environ["AGENT_RECORDS"] = sys.argv[1] + ".records.jsonl"
    cfg = JobConfig()
    cfg.rollout.max_new_tokens = 160
    recipe = load_recipe("tiny_tools")
    hf = resolve_path(recipe.hf_checkpoint)
    engine = RolloutEngine(cfg.rollout, recipe, hf, seed=0)
    tok = PromptTokenizer(hf)
    report = {}


    def problems(n, prefix="p"):
        sums = ["3+5+2+8+1=", "9+9+9+9=", "1+2+3+4+5+6=", "7+1+2+6+3+3+8=", "4+4+1+5+9=", "2+7+1=", "8+8+2+6+1=", "5+5+5="]
        chains = [sums[i % len(sums)] for i in range(n)]
        return [Problem(f"{prefix}{i}", c, str(sum(int(x) for x in c[:-1].split("+")))) for i, c in enumerate(chains)]


    def driver_for(agent: str, timeout_s: float = 120.0, max_turns: int = 4):
        task = AgentTask(f"__main__:{agent}", timeout_s, max_turns)
        serving = AgentServing.start(task, tok, "tiny-tools", cfg.rollout)
        return new_driver(engine, task, tok, 1, None, serving), serving


    # 1. 64 calculator episodes in flight, a weight sync in the middle
    driver, serving = driver_for("recorded_calc", max_turns=3)
    requests = [r for i, p in enumerate(problems(8)) for r in make_group_requests(p, i, driver.task, tok, 8, 160, 0, 0)]
    for req in requests:
        driver.add(req)
    finished, synced, most_in_flight = [], False, 0
    while driver.num_active:
        most_in_flight = max(most_in_flight, driver.num_active)
        finished += driver.step()
        if not synced and engine.num_active >= 16 and sum(len(r.output_ids) for r in requests) > 400:
            held = driver.hold_all()
            engine.load_weights(iter(load_file(os.path.join(hf, "model.safetensors")).items()), version=1)
            driver.resume(held)
            synced = True
    exact, layouts = True, True
    returned: dict[str, list[list[int]]] = {}
    for line in records():
        if line["kind"] == "returned":
            returned.setdefault(line["key"], []).append(line["value"])
    calls_by_episode = sorted(returned.values(), key=len)
    for req in finished:
        model = [t for a, b in req.model_spans for t in req.output_ids[a:b]]
        layouts &= len(req.logprobs) == len(req.versions) == len(model) and req.versions == sorted(req.versions)
        exact &= any(model == [t for call in calls for t in call] for calls in calls_by_episode)
    report["calc"] = {
        "finished": len(finished), "most_in_flight": most_in_flight, "synced": synced, "token_exact": bool(exact),
        "layouts": bool(layouts), "spanning_sync": sum(1 for r in finished if set(r.versions) == {0, 1}),
        "multi_turn": sum(1 for r in finished if len(r.model_spans) > 1),
        "mismatches": sum(r.meta["token_mismatches"] for r in finished),
        # special tokens inside a model turn (not the EOS that ends it): the API's text leaves them out
        "special_in_turns": sum(
            1 for r in finished for a, b in r.model_spans for i in range(a, b)
            if r.output_ids[i] in tok.tok.all_special_ids and not (i == b - 1 and r.output_ids[i] == tok.tok.eos_token_id)),
        "failures": sorted({r.meta["agent_failure"] for r in finished}),
        "rewards": sorted({r.reward for r in finished}), "engine_left": engine.num_active,
        # the built-in task's reward of the trajectory's text: the agent's transcript is what was trained
        "rewards_as_builtin": sum(
            r.reward == TASK.reward(r.meta["problem"], tok.tok.decode(r.output_ids, skip_special_tokens=True))
            for r in finished),
        "routes_left": len(serving.host.drivers),
    }
    serving.close()

    # 2. a chat agent, failures, malformed calls: one driver each, run to their ends
    for agent, timeout_s, max_turns in (("chat", 120, 4), ("raiser", 120, 4), ("sleeper", 3, 4), ("hog", 120, 3),
                                         ("malformed", 120, 4)):
        driver, serving = driver_for(agent, timeout_s, max_turns)
        requests = [r for i, p in enumerate(problems(2, agent))
                    for r in make_group_requests(p, i, driver.task, tok, 2, 160, 0, 0)]
        done = driver.generate(requests)
        report[agent] = {
            "finished": len(done), "failures": sorted({r.meta["agent_failure"] for r in done}),
            "rewards": sorted({r.reward for r in done}), "calls": sorted({len(r.model_spans) for r in done}),
            "mismatches": sum(r.meta["token_mismatches"] for r in done), "engine_left": engine.num_active,
            "routes_left": len(serving.host.drivers),
        }
        serving.close()
    report["status"] = {kind: values[-1] if kind == "malformed" else values for kind, values in status().items()}

    # 3. a stop with turns in the engine
    driver, serving = driver_for("long_call")
    requests = [r for i, p in enumerate(problems(4, "stop")) for r in make_group_requests(p, i, driver.task, tok, 1, 160, 0, 0)]
    for req in requests:
        driver.add(req)
    while engine.num_active < len(requests):
        driver.step()
    dropped = driver.drop_all()
    for _ in range(100):  # the refusals reach the agents on their own loop
        if len(status().get("dropped", [])) == len(requests):
            break
        time.sleep(0.05)
    report["stop"] = {"dropped": len(dropped), "engine_left": engine.num_active, "active_left": driver.num_active,
                      "refused": status().get("dropped", []), "routes_left": len(serving.host.drivers)}
    serving.close()

    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":  # (math-verify's spawned child imports this module)
    main()
