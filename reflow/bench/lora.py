"""LoRA against full fine-tuning: what a weight sync moves and costs, and what the rollout loses to it.

    python -m reflow.bench lora [--out outputs/bench/lora.json] [--steps 20] [--rank 16] [--gpu-rank 64]

1. Bytes per sync, from the sync plans of each model shape (built on the meta device, nothing allocated): the
   full weights (``reflow.weight_sync.broadcast``) against the adapters (``reflow.weight_sync.adapters``),
   both in the engine's dtype, for the tiny model at ``--rank`` and for the Qwen3 recipes at ``--gpu-rank``,
   every projection adapted. Target: >= 20x fewer bytes.
2. Live, 2 ranks, reflow mode, the same task and settings: ``train_configs/tiny_lora.toml`` (adapter syncs)
   against the same config with lora.rank = 0 (full fine-tuning, full-weight syncs, at tiny_retool's lr).
   Per run: the trainer's sync time, the rollout side's time in syncs, the requests a sync held and prefilled
   again (``rollout_held_at_sync``; target 0 with LoRA), tokens/s and step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {"tiny": "tiny_tools", "qwen3_8b": "qwen3_8b", "qwen3_32b": "qwen3_32b"}


def sync_bytes(recipe_name: str, rank: int) -> dict:
    import torch

    from reflow.config.job_config import LoraSection
    from reflow.model.qwen3 import build_model_config
    from reflow.model.recipe import load_recipe
    from reflow.trainer.hf_io import build_adapter
    from reflow.trainer.lora import build_adapter_plan
    from reflow.weight_sync.broadcast import build_sync_plan

    recipe = load_recipe(recipe_name)
    model_cfg = build_model_config(recipe, "sdpa")
    adapter = build_adapter(model_cfg, None)
    engine_dtype = getattr(torch, recipe.vllm.dtype) if recipe_name != "tiny_tools" else torch.float32
    full = build_sync_plan(model_cfg, adapter, 64.0, engine_dtype).numel * torch.empty(0, dtype=engine_dtype).element_size()
    lora = build_adapter_plan(model_cfg, adapter, LoraSection(rank=rank), "", engine_dtype)
    lora = lora.numel * torch.empty(0, dtype=engine_dtype).element_size()
    return {"recipe": recipe_name, "lora_rank": rank, "engine_dtype": str(engine_dtype).removeprefix("torch."),
            "full_bytes": full, "adapter_bytes": lora, "ratio": full / lora}


def run(name: str, overrides: list[str], args) -> dict:
    from reflow.bench.launch import cpu_env, free_port

    dump = os.path.join(args.work_dir, name)
    shutil.rmtree(dump, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "reflow.train", "--config", "train_configs/tiny_lora.toml", f"--job.dump_folder={dump}",
        f"--training.steps={args.steps}", "--metrics.eval_interval=0", "--metrics.enable_progress_bar=false",
        "--checkpoint.enable=false", "--checkpoint.export_hf=false", "--job.cpu_affinity=true", *overrides,
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if "loss" in row]
    later = rows[2:]  # (the first steps pay the engines' and the trainer's first-use costs)
    syncs = sum(r.get("rollout_syncs", 0) for r in later)
    return {
        "command": " ".join(cmd[3:]), "wall_s": time.time() - t0, "steps": len(rows),
        "trainer_sync_s_mean": statistics.mean(r["weight_sync_s"] for r in later),
        "rollout_sync_s_per_sync": sum(r.get("rollout_sync_s", 0.0) for r in later) / max(syncs, 1),
        "held_at_sync": sum(r.get("rollout_held_at_sync", 0) for r in rows),
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in later),
        "step_time_s_mean": statistics.mean(r["step_time_s"] for r in later),
        "reward_mean_last5": statistics.mean(r["reward_mean"] for r in rows[-5:]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m reflow.bench lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["lora"])
    ap.add_argument("--out", default="outputs/bench/lora.json")
    ap.add_argument("--work-dir", default="outputs/bench/lora_runs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=16, help="the tiny model's adapters (tiny_lora.toml's)")
    ap.add_argument("--gpu-rank", type=int, default=64, help="the Qwen3 recipes' adapters")
    args = ap.parse_args(argv)
    bytes_rows = [sync_bytes(SHAPES["tiny"], args.rank)]
    bytes_rows += [sync_bytes(SHAPES[name], args.gpu_rank) for name in ("qwen3_8b", "qwen3_32b")]
    for row in bytes_rows:
        print(f"{row['recipe']}: full {row['full_bytes'] / 2**20:.1f} MiB, adapters (r {row['lora_rank']}) "
              f"{row['adapter_bytes'] / 2**20:.2f} MiB: {row['ratio']:.1f}x", file=sys.stderr)
    live = {
        "lora": run("lora", [], args),
        "full": run("full", ["--lora.rank=0", "--training.lr=2e-4"], args),
    }
    result = {
        "benchmark": "lora", "command": "python -m reflow.bench " + " ".join(argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "sync_bytes": bytes_rows,
        "live": live,
        "lora_over_full": {
            "trainer_sync_s": live["lora"]["trainer_sync_s_mean"] / live["full"]["trainer_sync_s_mean"],
            "tokens_per_s": live["lora"]["tokens_per_s"] / live["full"]["tokens_per_s"],
            "step_time_s": live["lora"]["step_time_s_mean"] / live["full"]["step_time_s_mean"],
        },
        "target": {"bytes_ratio_min": 20.0, "met": all(r["ratio"] >= 20 for r in bytes_rows[1:]),
                   "lora_held_at_sync": live["lora"]["held_at_sync"]},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("sync_bytes", "lora_over_full", "target")}, indent=1))
    print(json.dumps({name: {k: v for k, v in r.items() if k != "command"} for name, r in live.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
