"""Score a Hugging Face policy folder on a task's eval file with the embedded vLLM engine.

    python -m reflow.bench.evaluate --hf outputs/bench/reflow/hf_final [--num-prompts 256 --samples 4]

Prints one JSON line: mean reward over num_prompts x samples completions at the rollout temperature.
"""

from __future__ import annotations

import argparse
import json
import sys


def evaluate(hf_dir: str, eval_file: str, task_name: str, num_prompts: int, samples: int, seed: int, max_new_tokens: int) -> dict:
    from reflow.config.job_config import JobConfig
    from reflow.model.recipe import load_recipe
    from reflow.modes.rollouts import PromptTokenizer, make_group_requests, score
    from reflow.rollout.engine import RolloutEngine
    from reflow.rollout.turns import TurnDriver
    from reflow.tasks import build_task, load_problems

    cfg = JobConfig()
    cfg.rollout.max_new_tokens = max_new_tokens
    cfg.task.name = task_name
    engine = RolloutEngine(cfg, load_recipe("tiny"), hf_dir, seed=seed)
    tok = PromptTokenizer(hf_dir)
    task = build_task(cfg.task)
    problems = load_problems(eval_file)[:num_prompts]
    reqs = [r for i, p in enumerate(problems) for r in make_group_requests(p, i, task, tok, samples, max_new_tokens, seed, 0)]
    done = score(TurnDriver(engine, task.environment, tok).generate(reqs), task, tok)
    rewards = [s.reward for s in done]
    return {
        "hf": hf_dir,
        "num_completions": len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "solved_frac": sum(r >= 1.0 for r in rewards) / len(rewards),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--eval-file", default="assets/data/chain_sum_eval.jsonl")
    ap.add_argument("--task", default="chain_sum")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    print(json.dumps(evaluate(a.hf, a.eval_file, a.task, a.num_prompts, a.samples, a.seed, a.max_new_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
