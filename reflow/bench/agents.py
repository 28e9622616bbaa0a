"""An agent through the endpoint against the built-in multi-turn driver, on the same task and the same engine.

    python -m reflow.bench agents [--out outputs/bench/agents.json] [--prompts 32] [--group-size 8] [--repeats 3]

One process, one vLLM engine (the tiny tools recipe, ``train_configs/tiny_agent.toml``'s rollout settings).
The same trajectories (the first ``--prompts`` rows of the calculator task's eval file, ``--group-size``
samples each, the same sampling seeds) are generated twice per repeat, in alternating order:

  builtin  ``reflow.rollout.turns.TurnDriver`` with the built-in ``chain_sum_calculator`` task: the calculator
           answers each ``</calc>`` on the tool pool, and the trajectory re-enters the engine
  agent    ``reflow.serving.agents.AgentDriver`` with the example agent (``reflow.examples.calculator_agent``):
           every turn is an HTTP call from an ``openai.AsyncOpenAI`` client through the rank's endpoint, both in
           the agents' process (``reflow.serving.agent_host``), apart from the engine's

Each reports the model tokens sampled per second of wall time (``model_tokens_per_s``; tool tokens are not
counted) and the trajectories' mean reward. For the agent: each call's overhead, which is the latency the client saw
less the time its turn spent in the engine (HTTP, parsing, tokenizing, the wait for the next engine step,
the answer's way back), as p50 and p99 in milliseconds, over every call and over the later calls of each
episode (a first call's overhead includes its wait for a place among the starting agents,
``agent_host.STARTING_AT_ONCE``, and the engine's queue), and each episode's start: from the
generation's start to its agent's first call (``first_call_after_ms``). Target: agent >= 0.85x
builtin's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

CALLS_FILE = "REFLOW_BENCH_CALLS"
"""The environment variable naming the file where the agents' process writes each call as its client saw it:
a line "route sent answered" (the perf counter is the machine's monotonic clock, the same in both processes)."""


class _TimedCompletions:
    def __init__(self, client):
        self.client = client
        self.route = str(client.base_url).rstrip("/").split("/episodes/")[1].split("/")[0]

    async def create(self, **kwargs):
        sent = time.perf_counter()
        out = await self.client.completions.create(**kwargs)
        with open(os.environ[CALLS_FILE], "a") as f:
            f.write(f"{self.route} {sent!r} {time.perf_counter()!r}\n")
        return out


class _TimedClient:
    def __init__(self, client):
        self.completions = _TimedCompletions(client)


async def timed_solve(client, row):
    """The example agent, with its client's calls timed."""
    from reflow.examples.calculator_agent import solve

    return await solve(_TimedClient(client), row)


def _calls(path: str) -> dict[str, list[tuple[float, float]]]:
    """Each episode's calls as its client saw them, by route: (sent, answered)."""
    calls: dict[str, list[tuple[float, float]]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                route, sent, answered = line.split()
                calls.setdefault(route, []).append((float(sent), float(answered)))
    return calls


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m reflow.bench agents", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["agents"])
    ap.add_argument("--out", default="outputs/bench/agents.json")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default="train_configs/tiny_agent.toml")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    calls_file = os.path.abspath(args.out) + ".calls"
    os.environ[CALLS_FILE] = calls_file  # (before the agents' process starts: it inherits the environment)
    if os.path.exists(calls_file):
        os.remove(calls_file)
    import torch

    torch.set_num_threads(1)
    from reflow.config import ConfigManager
    from reflow.model.recipe import load_recipe, resolve_path
    from reflow.rollout.engine import RolloutEngine
    from reflow.rollout.groups import make_group_requests
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.rollout.turns import TurnDriver
    from reflow.serving.agents import AgentDriver
    from reflow.serving.drivers import AgentServing
    from reflow.tasks import load_problems
    from reflow.tasks.agent import AgentTask
    from reflow.tasks.calculator import ChainSumCalculatorTask

    cfg = ConfigManager().parse_args(["--config", args.config])
    recipe = load_recipe(cfg.model.recipe)
    hf = resolve_path(recipe.hf_checkpoint)
    engine = RolloutEngine(cfg.rollout, recipe, hf, seed=0)
    tok = PromptTokenizer(hf)
    problems = load_problems(resolve_path(cfg.task.eval_file), "task.eval_file")[: args.prompts]
    builtin_task = ChainSumCalculatorTask(max_turns=cfg.task.max_turns - 1)  # (calls answered = calls - 1)
    agent_task = AgentTask(f"{__name__}:timed_solve", cfg.task.agent_timeout_s, cfg.task.max_turns)
    serving = AgentServing.start(agent_task, tok, recipe.name, cfg.rollout)
    drivers = {
        "builtin": (builtin_task, TurnDriver(engine, builtin_task, tok, cfg.task.tool_workers)),
        "agent": (agent_task, AgentDriver(engine, agent_task, tok, serving.host)),
    }
    starts: list[float] = []
    """When each generation began."""
    # the agent's per-turn engine time: when its turn entered the engine, and when it was answered
    in_engine: dict[str, list[tuple[float, float]]] = {}
    agent_driver = drivers["agent"][1]
    start_turn, answer = agent_driver._start_turn, agent_driver._answer

    def timed_start(episode, pending):
        start_turn(episode, pending)
        in_engine.setdefault(episode.route, []).append((time.perf_counter(), float("nan")))

    def timed_answer(req):
        episode = agent_driver.by_request.get(req.request_id)
        answer(req)
        if episode is not None and in_engine.get(episode.route):
            started, _ = in_engine[episode.route][-1]
            in_engine[episode.route][-1] = (started, time.perf_counter())

    agent_driver._start_turn, agent_driver._answer = timed_start, timed_answer

    def generate(name: str, seed: int) -> dict:
        task, driver = drivers[name]
        requests = [r for i, p in enumerate(problems)
                    for r in make_group_requests(p, i, task, tok, args.group_size, cfg.rollout.max_new_tokens, seed, 0)]
        t0 = time.perf_counter()
        starts.append(t0)
        done = driver.generate(requests)
        seconds = time.perf_counter() - t0
        model_tokens = sum(len(r.logprobs) for r in done)
        return {"seconds": seconds, "model_tokens": model_tokens, "model_tokens_per_s": model_tokens / seconds,
                "trajectories": len(done), "reward_mean": sum(r.reward or 0.0 for r in done) / max(len(done), 1),
                "tool_calls_mean": sum(r.tool_calls for r in done) / max(len(done), 1),
                "failures": sum(1 for r in done if r.meta.get("agent_failure"))}

    generate("builtin", 10_000)  # warm-up: neither side pays the first steps' one-time costs
    generate("agent", 10_000)
    if os.path.exists(calls_file):
        os.remove(calls_file)
    in_engine.clear()
    runs: dict[str, list[dict]] = {"builtin": [], "agent": []}
    for repeat in range(args.repeats):
        order = ("builtin", "agent") if repeat % 2 == 0 else ("agent", "builtin")
        for name in order:
            runs[name].append(generate(name, repeat))
            print(f"repeat {repeat} {name}: {runs[name][-1]['model_tokens_per_s']:.0f} model tokens/s", file=sys.stderr)
    serving.close()
    by_call = [
        (index, ((answered - sent) - (engine_end - engine_start)) * 1000)
        for route, calls in _calls(calls_file).items()
        for index, ((sent, answered), (engine_start, engine_end)) in enumerate(zip(calls, in_engine.get(route, [])))
    ]
    overheads = [ms for _, ms in by_call]
    first_after = [(calls[0][0] - max(t for t in starts if t <= calls[0][0])) * 1000
                   for calls in _calls(calls_file).values()]
    later = [ms for index, ms in by_call if index > 0]
    rate = {name: statistics.mean(r["model_tokens_per_s"] for r in rs) for name, rs in runs.items()}
    ratios = [a["model_tokens_per_s"] / b["model_tokens_per_s"] for a, b in zip(runs["agent"], runs["builtin"])]
    result = {
        "benchmark": "agents",
        "command": "python -m reflow.bench " + " ".join(argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": 1},
        "workload": {"config": args.config, "prompts": len(problems), "group_size": args.group_size,
                     "max_new_tokens": cfg.rollout.max_new_tokens, "calls_per_episode": cfg.task.max_turns},
        "runs": runs,
        "model_tokens_per_s": rate,
        "agent_over_builtin": rate["agent"] / rate["builtin"],
        "agent_over_builtin_per_repeat": ratios,
        "call_overhead_ms": {"calls": len(overheads), "p50": _percentile(overheads, 0.5),
                             "p99": _percentile(overheads, 0.99), "mean": statistics.mean(overheads) if overheads else None},
        # an episode's later calls, apart from the first (every episode of a generation is added at its start)
        "later_call_overhead_ms": {"calls": len(later), "p50": _percentile(later, 0.5), "p99": _percentile(later, 0.99)},
        "first_call_after_ms": {"episodes": len(first_after), "p50": _percentile(first_after, 0.5),
                                "p99": _percentile(first_after, 0.99)},
        "target": {"agent_over_builtin": 0.85, "met": rate["agent"] / rate["builtin"] >= 0.85},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("model_tokens_per_s", "agent_over_builtin", "call_overhead_ms",
                                             "later_call_overhead_ms", "first_call_after_ms", "target")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
