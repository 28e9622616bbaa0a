"""Side-by-side benchmark of the four training modes on one workload, world size and seed.

    python -m reflow.bench modes [--time-budget 60] [--world-size 2] [--out outputs/bench/modes.json] [-- --key=value ...]

Each mode runs as its own ``torchrun`` job on the same config (``train_configs/bench_modes.toml``:
a rollout-bound chain_sum workload whose answer lengths have a long tail), with every rank pinned to
its own core and one compute thread (``job.cpu_affinity``), so a waiting rank is really idle, as a GPU
would be. ``sync`` is colocated (every rank trains and generates); the decoupled modes split the world
into trainer and rollout ranks. Reported per mode:

  tokens_per_s          trainer tokens (fresh and replayed) / step time, over the steps after warm-up
  fresh_samples_per_s   first-use samples trained on / step time (generation that reached the trainer)
  trainer_idle_ratio    mean share of a step the trainer waited for data (after warm-up)
  rollout_idle_ratio    mean share of time rollout ranks had nothing to generate (after warm-up)
  staleness             share of trained samples (fresh and replayed) at each staleness, after warm-up:
                        how many policy versions older than the trainer the policy that began them was.
                        sync trains only staleness 0, one_step_off only 1, async and reflow up to delta
  reward_at_equal_time  every mode trains for the same wall-clock budget (training.time_budget_s); the
                        policy it ends with is scored on the held-out eval set (256 prompts x 4 samples,
                        one embedded vLLM engine, same seed), next to the starting checkpoint's score
  time_to_target_s      first time the 5-step moving average of the training reward reaches --target-reward
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from reflow.bench.launch import free_port

MODES = ("sync", "one_step_off", "async", "reflow")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_mode(mode: str, args, overrides: list[str]) -> dict:
    dump = os.path.join(args.work_dir, mode)
    if os.path.exists(os.path.join(dump, "metrics.jsonl")):
        os.remove(os.path.join(dump, "metrics.jsonl"))
    rollout_ranks = 0 if mode == "sync" else args.rollout_ranks
    # sync is on-policy by definition: it syncs after every step whatever the workload's interval
    per_mode = ["--weight_sync.interval=1"] if mode == "sync" else []
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world_size),
        "--master-port", str(free_port()),
        "-m", "reflow.train", "--config", args.config,
        f"--training.mode={mode}", f"--training.steps={args.steps}", f"--job.dump_folder={dump}",
        f"--training.time_budget_s={args.time_budget}",
        f"--placement.num_rollout_ranks={rollout_ranks}", "--job.cpu_affinity=true",
        "--metrics.enable_progress_bar=false", "--checkpoint.enable=false", "--checkpoint.export_hf=true",
        *overrides,
        *per_mode,
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {
        "rows": rows,
        "wall_s": wall,
        "command": " ".join(cmd),
        "placement": _placement_line(proc.stderr),
        "eval": evaluate_policy(os.path.join(dump, "hf_final"), env),
    }


def evaluate_policy(hf_dir: str, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "reflow.bench.evaluate", "--config", "train_configs/bench_modes.toml", "--hf", hf_dir],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation of {hf_dir} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _placement_line(stderr: str) -> str:
    for line in stderr.splitlines():
        if "trainer HSDP" in line:
            return line.split("] ", 1)[-1].strip()
    return ""


def summarize(rows: list[dict], warmup: int, equal_time_s: float, target: float) -> dict:
    post = rows[warmup:] or rows
    tokens = sum(r["trainer_tokens"] for r in post)
    time_s = sum(r["step_time_s"] for r in post)
    t, elapsed, rewards, hit = 0.0, [], [], None
    for i, r in enumerate(rows):
        t += r["step_time_s"]
        elapsed.append(t)
        rewards.append(r["reward_mean"])
        window = rewards[max(0, i - 4) : i + 1]
        if hit is None and len(window) == 5 and sum(window) / 5 >= target:
            hit = t
    in_window = [r for r, e in zip(rewards, elapsed) if 0.75 * equal_time_s <= e <= equal_time_s] or rewards[-1:]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {
        "staleness_distribution": staleness_distribution(post),
        "steps": len(rows),
        "tokens_per_s": tokens / time_s if time_s else 0.0,
        # first-use samples only: replayed tokens count in tokens_per_s (training throughput), not here
        "fresh_samples_per_s": sum(r["num_samples"] for r in post) / time_s if time_s else 0.0,
        "trainer_idle_ratio": mean([r["trainer_idle_ratio"] for r in post]),
        "rollout_idle_ratio": mean([r["rollout_idle_ratio"] for r in post]),
        "replay_fraction": mean([r.get("replay_fraction", 0.0) for r in post]),
        "reward_first5": mean(rewards[:5]),
        "reward_last5": mean(rewards[-5:]),
        "train_reward_last_quarter": mean(in_window),
        "train_time_s": elapsed[-1] if elapsed else 0.0,
        "time_to_target_s": hit,
    }


def staleness_distribution(rows: list[dict]) -> dict[str, float]:
    """Share of the trained samples of ``rows`` at each staleness ({"0": 0.1, "1": 0.9})."""
    totals: list[int] = []
    for row in rows:
        for age, count in enumerate(row["staleness_counts"]):
            totals.extend([0] * (age + 1 - len(totals)))
            totals[age] += count
    trained = sum(totals)
    return {str(age): count / trained for age, count in enumerate(totals)} if trained else {}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m reflow.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["modes"])
    ap.add_argument("--config", default="train_configs/bench_modes.toml")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=1000, help="step cap; the time budget normally ends the run")
    ap.add_argument("--time-budget", type=float, default=60.0, help="training seconds per mode (equal wall-clock)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rollout-ranks", type=int, default=1)
    ap.add_argument("--target-reward", type=float, default=0.1)
    ap.add_argument("--work-dir", default="outputs/bench")
    ap.add_argument("--out", default="outputs/bench/modes.json")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown mode(s) {unknown} (known: {', '.join(MODES)})")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    runs = {}
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    print("[bench] scoring the starting checkpoint ...", file=sys.stderr, flush=True)
    start_eval = evaluate_policy(os.path.join(ROOT, "assets", "tiny-qwen3"), env)
    for mode in modes:
        print(f"[bench] {mode} ...", file=sys.stderr, flush=True)
        runs[mode] = run_mode(mode, args, overrides)
    equal_time = min(sum(r["step_time_s"] for r in run["rows"]) for run in runs.values())
    result = {
        "benchmark": "modes",
        "config": args.config,
        "overrides": overrides,
        "world_size": args.world_size,
        "rollout_ranks": args.rollout_ranks,
        "cpu_affinity": "each rank pinned to its own core, 1 compute thread (job.cpu_affinity=true)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "target_reward": args.target_reward,
        "equal_time_s": equal_time,
        "time_budget_s": args.time_budget,
        "start_eval_reward": start_eval["reward_mean"],
        "modes": {},
    }
    for mode, run in runs.items():
        s = summarize(run["rows"], args.warmup, equal_time, args.target_reward)
        s.update(placement=run["placement"], wall_s=run["wall_s"], command=run["command"])
        s["eval_reward_at_equal_time"] = run["eval"]["reward_mean"]
        s["eval_solved_frac"] = run["eval"]["solved_frac"]
        result["modes"][mode] = s
    others = [m for m in result["modes"] if m != "reflow"]
    if "reflow" in result["modes"] and others:
        best = max(others, key=lambda m: result["modes"][m]["tokens_per_s"])
        result["reflow_speedup_vs_best_other"] = result["modes"]["reflow"]["tokens_per_s"] / max(result["modes"][best]["tokens_per_s"], 1e-9)
        result["best_other_mode"] = best
        best_reward = max(others, key=lambda m: result["modes"][m]["eval_reward_at_equal_time"])
        result["best_other_mode_by_eval_reward"] = best_reward
        result["reflow_eval_reward_minus_best_other"] = (
            result["modes"]["reflow"]["eval_reward_at_equal_time"] - result["modes"][best_reward]["eval_reward_at_equal_time"]
        )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    write_png(png, result, {mode: run["rows"] for mode, run in runs.items()})
    print(format_table(result))
    print(f"[bench] wrote {args.out} and {png}", file=sys.stderr)


def write_png(path: str, result: dict, rows: dict[str, list[dict]]) -> None:
    """Training reward (mean of the last 5 steps) against wall-clock time per mode; the held-out eval reward at
    equal time (and of the starting policy); the trainer and rollout idle ratios."""
    from reflow.metrics.plot import bars, new_canvas, steps_line

    image, draw = new_canvas(1100, 640)
    horizon = max(sum(r["step_time_s"] for r in mode_rows) for mode_rows in rows.values())
    curves = {}
    for mode, mode_rows in rows.items():
        t, points = 0.0, []
        for i, r in enumerate(mode_rows):
            t += r["step_time_s"]
            window = [x["reward_mean"] for x in mode_rows[max(0, i - 4) : i + 1]]
            points.append((t / horizon, sum(window) / len(window)))
        curves[mode] = points
    steps_line(draw, (50, 30, 900, 290), f"training reward (last 5 steps) vs wall-clock, 0..{horizon:.0f}s", curves, 1.0)
    modes = result["modes"]
    evals = {"start": {"eval reward": result["start_eval_reward"]}} | {m: {"eval reward": s["eval_reward_at_equal_time"]} for m, s in modes.items()}
    bars(draw, (50, 350, 480, 600), f"held-out reward at equal time ({result['equal_time_s']:.0f}s)", evals, 1.0)
    idle = {m: {"trainer idle": s["trainer_idle_ratio"], "rollout idle": s["rollout_idle_ratio"]} for m, s in modes.items()}
    bars(draw, (560, 350, 960, 600), "idle ratios", idle, 1.0)
    image.save(path)
    return 0


def format_table(result: dict) -> str:
    head = (
        f"{'mode':<13}{'steps':>6}{'tok/s':>9}{'fresh/s':>9}{'trn idle':>10}{'roll idle':>10}{'replay':>8}"
        f"{'R first5':>10}{'R last5':>9}{'eval R@eq-t':>12}{'t->target':>11}  staleness 0/1/2/..."
    )
    lines = [f"starting checkpoint eval reward: {result['start_eval_reward']:.3f}", head, "-" * len(head)]
    for mode, s in result["modes"].items():
        ttt = f"{s['time_to_target_s']:.1f}s" if s["time_to_target_s"] is not None else "-"
        lines.append(
            f"{mode:<13}{s['steps']:>6}{s['tokens_per_s']:>9.0f}{s['fresh_samples_per_s']:>9.1f}{s['trainer_idle_ratio']:>10.2f}"
            f"{s['rollout_idle_ratio']:>10.2f}{s['replay_fraction']:>8.2f}{s['reward_first5']:>10.3f}{s['reward_last5']:>9.3f}"
            f"{s['eval_reward_at_equal_time']:>12.3f}{ttt:>11}  "
            + "/".join(f"{share:.2f}" for share in s["staleness_distribution"].values())
        )
    if "reflow_speedup_vs_best_other" in result:
        lines.append(f"reflow vs best other ({result['best_other_mode']}): {result['reflow_speedup_vs_best_other']:.2f}x tokens/s")
        lines.append(
            f"reflow eval reward at equal time minus the best other's ({result['best_other_mode_by_eval_reward']}): "
            f"{result['reflow_eval_reward_minus_best_other']:+.3f}"
        )
    return "\n".join(lines)
