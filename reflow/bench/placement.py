"""Placement that needs no tuning: ``python -m reflow.bench placement``.

On a 4-rank world (reflow mode, trainer shard degree 1, 6 prompts a step, which every split divides), every
static split of trainer and rollout ranks (1:3, 2:2, 3:1) and the adaptive placement planner
(``scheduler.adaptive_placement``, starting at 2:2) train for the same wall-clock budget on two workloads:

  rollout_heavy  ``train_configs/bench_rollout_bound.toml``: long-tail answers under KV pressure, so
                 generation sets the pace and more rollout ranks pay
  trainer_heavy  ``train_configs/bench_modes.toml`` with several updates per batch (training.ppo_epochs and
                 num_minibatches), so training sets the pace and more trainer ranks pay

Each run's tokens/s (trained tokens over the step seconds past the warm-up steps) is compared with the best
static split's on the same workload: adaptive / best static, target >= 0.95 on each. The JSON keeps every run's
numbers, its placement per step and the planner's decisions (the adaptive run's placement rows).

This machine's speed drifts between runs minutes apart (one session's static splits moved by up to 12% from one
bench to the next, and one bench's adaptive runs, both run last, came out 0.85x and 0.78x while the planner
stood in the best split or the second-best for most of their steps). ``--rounds N`` runs every configuration N
times, each round in an order rotated by one (the adaptive run last in the first round, first in the second),
and judges the mean tokens/s of each configuration over the rounds; the JSON also keeps each round's ratio.

    python -m reflow.bench placement [--time-budget 90] [--rounds 1] [--workloads rollout_heavy,trainer_heavy]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from reflow.bench.launch import ROOT, cpu_env, free_port

WORLD = 4
WORKLOADS = {
    "rollout_heavy": ("train_configs/bench_rollout_bound.toml", []),
    "trainer_heavy": ("train_configs/bench_modes.toml", ["--training.ppo_epochs=2", "--training.num_minibatches=4"]),
}
STATIC = {f"static_{trainers}:{WORLD - trainers}": trainers for trainers in range(1, WORLD)}
"""Static splits by trainer ranks (shard degree 1: one replica per trainer rank)."""
PROMPTS_PER_STEP = 6
"""Every run's batch: whole groups split evenly over 1, 2 or 3 trainer shards (6 prompts x group size)."""
TARGET = 0.95


def placement_overrides(run: str) -> list[str]:
    """The placement a run takes: a static split, or the planner starting at the even split."""
    trainers = STATIC.get(run, WORLD // 2)
    out = [
        "--training.mode=reflow", f"--training.prompts_per_step={PROMPTS_PER_STEP}", "--placement.trainer_shard_degree=1",
        f"--placement.trainer_replicate_degree={trainers}",
        f"--placement.num_rollout_ranks={WORLD - trainers}",
    ]
    return out + (["--scheduler.adaptive_placement=true"] if run == "adaptive" else ["--scheduler.adaptive_placement=false"])


RUNS = [*STATIC, "adaptive"]


def round_orders(rounds: int) -> list[list[str]]:
    """Each round's run order: the static splits then the adaptive run, rotated right by one more each round (so
    the adaptive run goes last, then first)."""
    return [RUNS[-k % len(RUNS):] + RUNS[:-k % len(RUNS)] for k in range(rounds)]


def judge(rounds: list[dict[str, dict]]) -> dict:
    """Adaptive against the best static split over the rounds: each configuration's mean tokens/s, the best
    static split by that mean, their ratio (the target's), and each round's own ratio against the same split."""
    mean = {name: sum(r[name]["tokens_per_s"] for r in rounds) / len(rounds) for name in RUNS}
    best = max(STATIC, key=mean.__getitem__)
    ratio = mean["adaptive"] / mean[best]
    return {
        "tokens_per_s": mean, "best_static": best, "adaptive_vs_best_static": ratio, "met": ratio >= TARGET,
        "per_round": [r["adaptive"]["tokens_per_s"] / r[best]["tokens_per_s"] for r in rounds],
    }


def run_one(workload: str, run: str, args, round_name: str = "") -> dict:
    config, extra = WORKLOADS[workload]
    dump = os.path.join(args.work_dir, workload, round_name, run.replace(":", "-"))
    shutil.rmtree(dump, ignore_errors=True)  # the bench's own folder: a run there starts afresh (reflow.run_record)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port", str(free_port()),
        "-m", "reflow.train", "--config", config, *extra, *placement_overrides(run), f"--job.dump_folder={dump}",
        f"--training.steps={args.steps}", f"--training.time_budget_s={args.time_budget}", "--job.cpu_affinity=true",
        "--metrics.enable_progress_bar=false", "--metrics.eval_interval=0", "--checkpoint.enable=false",
        "--checkpoint.export_hf=false",
    ]
    env = cpu_env()
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload} {run} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return summarize(rows, args.warmup) | {"wall_s": time.time() - t0, "command": " ".join(cmd)}


def summarize(rows: list[dict], warmup: int) -> dict:
    """Tokens/s past the warm-up steps, the placements the run trained in (steps each) and its decisions."""
    steps = [r for r in rows if "loss" in r]
    post = steps[warmup:] or steps
    seconds = sum(r["step_time_s"] for r in post)
    placements: dict[str, int] = {}
    for r in steps:
        placements[r.get("placement", "")] = placements.get(r.get("placement", ""), 0) + 1
    return {
        "steps": len(steps),
        "tokens_per_s": sum(r["trainer_tokens"] for r in post) / max(seconds, 1e-9),
        "fresh_samples_per_s": sum(r["fresh_samples"] for r in post) / max(seconds, 1e-9),
        "trainer_idle_ratio": sum(r["trainer_idle_ratio"] * r["step_time_s"] for r in post) / max(seconds, 1e-9),
        "rollout_idle_ratio": sum(r.get("rollout_idle_ratio", 0.0) * r["step_time_s"] for r in post) / max(seconds, 1e-9),
        "steps_per_placement": placements,
        "decisions": [  # the planner's logged decisions (a changed target, or a reason it kept the split)
            {k: r[k] for k in ("step", "planner_current_replicas", "planner_target_replicas", "planner_reason") if k in r}
            for r in rows if "planner_reason" in r
        ],
        "transitions": [
            {k: r[k] for k in ("step", "transition", "transition_s") if k in r} for r in rows if "transition" in r
        ],
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m reflow.bench placement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["placement"])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--time-budget", type=float, default=90.0, help="training seconds per run (equal wall-clock)")
    ap.add_argument("--steps", type=int, default=1000, help="step cap; the time budget normally ends the run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every configuration, each round in a rotated order")
    ap.add_argument("--work-dir", default="outputs/bench_placement")
    ap.add_argument("--out", default="outputs/bench_placement/placement.json")
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"--workloads: unknown {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    result: dict = {"benchmark": "placement", "world_size": WORLD, "time_budget_s": args.time_budget,
                    "warmup_steps": args.warmup, "rounds": args.rounds, "target": TARGET, "workloads": {}}
    for workload in workloads:
        rounds = []
        for index, order in enumerate(round_orders(args.rounds)):
            runs = {}
            for run in order:
                print(f"[bench] {workload}: round {index + 1}/{args.rounds} {run} ...", file=sys.stderr, flush=True)
                runs[run] = run_one(workload, run, args, "" if args.rounds == 1 else f"round{index + 1}")
            rounds.append(runs)
        judged = judge(rounds)
        result["workloads"][workload] = {
            "config": WORKLOADS[workload][0], "overrides": WORKLOADS[workload][1],
            "runs": rounds[0] if args.rounds == 1 else {name: [r[name] for r in rounds] for name in rounds[0]},
            **judged,
        }
        print(f"{workload}: " + "  ".join(f"{name} {value:.0f}" for name, value in judged["tokens_per_s"].items())
              + f"  adaptive / best static ({judged['best_static']}) {judged['adaptive_vs_best_static']:.3f}"
              + (f"  per round {' '.join(f'{x:.3f}' for x in judged['per_round'])}" if args.rounds > 1 else ""),
              flush=True)
    result["met"] = all(w["met"] for w in result["workloads"].values())
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0
