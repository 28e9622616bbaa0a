"""Score a Hugging Face policy folder on a training config's task and eval file with the embedded vLLM engine.

    python -m reflow.bench.evaluate --config train_configs/tiny_retool.toml [--hf outputs/x/hf_final]
                                    [--num-prompts 256 --samples 4 --out result.json] [--section.key=value ...]

The task, its environment (turn limit, sandbox limits), the eval file and the rollout settings come from the
config; --hf replaces the model (default: the config's). Prints one JSON object: the mean reward over
num_prompts x samples completions at the rollout temperature, the solved fraction, and for a multi-turn task
the tool calls per completion.
"""

from __future__ import annotations

import argparse
import json
import sys


def evaluate(config: str, hf_dir: str, num_prompts: int, samples: int, seed: int, overrides: list[str] = ()) -> dict:
    from reflow.config import ConfigManager
    from reflow.model.recipe import load_recipe, resolve_path
    from reflow.rollout.engine import RolloutEngine
    from reflow.rollout.groups import make_group_requests
    from reflow.rollout.scoring import score
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.serving.drivers import AgentServing, new_driver
    from reflow.tasks import build_task, load_problems

    cfg = ConfigManager().parse_args(["--config", config, *overrides])
    recipe = load_recipe(cfg.model.recipe)
    hf_dir = resolve_path(hf_dir or cfg.model.hf_checkpoint or recipe.hf_checkpoint)
    engine = RolloutEngine(cfg.rollout, recipe, hf_dir, seed=seed)
    tok = PromptTokenizer(hf_dir, cfg.task.chat)
    task = build_task(cfg.task)
    problems = load_problems(resolve_path(cfg.task.eval_file), "task.eval_file")
    if num_prompts:
        problems = problems[:num_prompts]
    requests = [
        r for i, p in enumerate(problems)
        for r in make_group_requests(p, i, task, tok, samples, cfg.rollout.max_new_tokens, seed, 0)
    ]
    agents = AgentServing.start(task, tok, recipe.name, cfg.rollout)
    done = score(new_driver(engine, task, tok, cfg.task.tool_workers, agents=agents).generate(requests), task, tok)
    if agents is not None:
        agents.close()
    rewards = [s.reward for s in done]
    return {
        "config": config,
        "hf": hf_dir,
        "task": cfg.task.name,
        "num_prompts": len(problems),
        "num_completions": len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "solved_frac": sum(r >= 1.0 for r in rewards) / len(rewards),
        "tool_calls_mean": sum(s.tool_calls for s in done) / len(done),
    }


def main(argv: list[str] | None = None) -> int:
    import os

    # stdout carries the result alone: vLLM's log lines go to stderr (set before vLLM is imported)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    ap = argparse.ArgumentParser(prog="python -m reflow.bench.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="train_configs/tiny.toml")
    ap.add_argument("--hf", default="", help="the policy to score (default: the config's model)")
    ap.add_argument("--num-prompts", type=int, default=256, help="the first N eval prompts (0: all)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="", help="also write the JSON here")
    a, overrides = ap.parse_known_args(argv)
    unknown = [arg for arg in overrides if not arg.startswith("--") or "=" not in arg]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides are --section.key=value)")
    try:
        if a.hf:
            from reflow.trainer.hf_io import check_hf_dir

            check_hf_dir(a.hf, "--hf")
        result = evaluate(a.config, a.hf, a.num_prompts, a.samples, a.seed, overrides)
    except ValueError as error:  # a bad --hf folder, config or eval file: one line
        print(f"reflow.bench.evaluate: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
