"""Trainer replica resize against a cold restart, and bucketized against per-tensor shard transfer.

    python -m reflow.bench resize [--out outputs/bench/resize.json] [--world-size 4] [--deep-layers 24]

One ``torchrun`` job of ``--world-size`` ranks (shard degree 2, so trainer placements 2x2 and 1x2 on 4 ranks)
running the project's trainer on the tiny recipe:

  transitions              trainer -> rollout (2x2 -> 1x2: ranks 2, 3 leave, nothing moves) and
                           rollout -> trainer (1x2 -> 2x2: ranks 2, 3 receive parameter, AdamW and step
                           shards by bucketized broadcast), each timed on the slowest rank, with the bytes
                           moved to the joining ranks
  cold_restart_s           the same 2x2 -> 1x2 change done without the elastic path: a distributed
                           checkpoint of model and optimizer, every trainer and every vLLM engine torn down
                           and rebuilt (engines are collective to build, so every rank rebuilds), the
                           checkpoint loaded on the new placement. Process restart and process-group setup
                           are not counted, so this is a lower bound of what a user's restart costs
  bucketized_vs_per_tensor the shard transfer alone, on a ``--deep-layers`` model (hundreds of tensors per
                           shard): one broadcast per tensor, then flat buckets of several sizes (median of 3)

Targets: each transition under 5% of cold_restart_s; bucketized at least 5x faster than per-tensor at the
best bucket size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

from reflow.bench.launch import run_worker

BUCKET_SIZES_MB = (0.25, 1.0, 4.0, 16.0)


def slowest(t0: float) -> float:
    """Seconds since ``t0`` on the slowest rank (every rank calls)."""
    import torch
    import torch.distributed as dist

    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def summed(value: int) -> int:
    import torch
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(total)
    return int(total.item())


def worker(out_path: str, deep_layers: int, scratch: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from reflow.config.job_config import JobConfig
    from reflow.distributed import build_trainer_layouts, init_distributed
    from reflow.distributed.buckets import broadcast_tensors
    from reflow.model.qwen3 import build_model_config, build_on_meta
    from reflow.model.recipe import load_recipe, resolve_path
    from reflow.rollout.engine import RolloutEngine
    from reflow.trainer.elastic import shard_tensors, zero_optimizer_state
    from reflow.trainer.parallelize import apply_fsdp
    from reflow.trainer.policy import PolicyTrainer

    rank, world, device = init_distributed()
    torch.set_num_threads(1)
    shard_degree = 2
    most = world // shard_degree
    cfg = JobConfig()
    recipe = load_recipe("tiny")
    hf_dir = resolve_path(recipe.hf_checkpoint)
    bucket_bytes = int(cfg.weight_sync.bucket_size_mb * 2**20)
    layouts = build_trainer_layouts(world, shard_degree, list(range(1, most + 1)))
    engine = RolloutEngine(cfg.rollout, recipe, hf_dir, seed=rank)
    trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, most, device)
    report: dict = {"transitions": []}

    # 1. the elastic path, both directions
    for replicas in (most - 1, most):
        dist.barrier()
        t0 = time.perf_counter()
        moved = trainer.resize(replicas, bucket_bytes=bucket_bytes)
        seconds = slowest(t0)
        report["transitions"].append(
            {
                "direction": moved.direction, "from": moved.source, "to": moved.target, "seconds": seconds,
                "bytes_moved": summed(moved.bytes_moved), "broadcasts": moved.broadcasts,
            }
        )

    # 2. the cold path for the same 2x2 -> 1x2 change: checkpoint, tear down, rebuild, load
    path = os.path.join(scratch, "cold")
    dist.barrier()
    t0 = time.perf_counter()
    old = layouts[most]
    state = {"trainer": trainer.state_dict()}
    dcp.save(state, checkpoint_id=path, process_group=old.group)
    save_s = slowest(t0)
    del trainer, state, engine
    t1 = time.perf_counter()
    engine = RolloutEngine(cfg.rollout, recipe, hf_dir, seed=rank)
    engine_s = slowest(t1)
    report["engine_build_s_rank0"] = engine.build_time_s
    t2 = time.perf_counter()
    new = layouts[most - 1]
    if new.has(rank):
        trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, {most - 1: new}, most - 1, device)
        state = {"trainer": trainer.state_dict()}
        dcp.load(state, checkpoint_id=path, process_group=new.group)
        trainer.load_state_dict(state["trainer"])
    rebuild_s = slowest(t2)
    report["cold_restart_s"] = slowest(t0)
    report["cold_restart_parts_s"] = {"checkpoint_save": save_s, "engine_rebuild": engine_s,
                                      "trainer_rebuild_and_load": rebuild_s}

    # 3. the shard transfer alone, per tensor and bucketized, on a deep model
    arch = dataclasses.replace(recipe.architecture, n_layers=deep_layers)
    deep_cfg = build_model_config(dataclasses.replace(recipe, architecture=arch), "sdpa")
    layout = layouts[most]
    model = apply_fsdp(build_on_meta(deep_cfg), layout.mesh)
    model.to_empty(device=device)
    optimizer = torch.optim.AdamW(model.parameters())
    zero_optimizer_state(optimizer, model)
    tensors = shard_tensors(model, optimizer, None)
    group = layout.mesh.get_group("dp_replicate")
    source = rank % shard_degree
    timings = {}
    for label, size in [("per_tensor", None)] + [(f"{mb}MB", int(mb * 2**20)) for mb in BUCKET_SIZES_MB]:
        runs = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            count = broadcast_tensors(tensors, source, group, size)
            runs.append(slowest(t0))
        timings[label] = {"seconds": statistics.median(runs), "broadcasts": count}
    best = min((k for k in timings if k != "per_tensor"), key=lambda k: timings[k]["seconds"])
    report["bucketized_vs_per_tensor"] = {
        "model_layers": deep_layers,
        "tensors_per_shard": len(tensors),
        "bytes_per_shard": sum(t.numel() * t.element_size() for t in tensors),
        "timings": timings,
        "best_bucket": best,
        "speedup_at_best": timings["per_tensor"]["seconds"] / timings[best]["seconds"],
    }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m reflow.bench resize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["resize"])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--deep-layers", type=int, default=24)
    ap.add_argument("--out", default="outputs/bench/resize.json")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # set by the launcher: where rank 0 writes
    args = ap.parse_args(argv)
    if args.world_size < 4 or args.world_size % 2:
        ap.error("--world-size must be an even number >= 4 (shard degree 2, at least two replicas)")
    if args.worker:
        scratch = os.environ["REFLOW_BENCH_SCRATCH"]
        worker(args.worker, args.deep_layers, scratch)
        return 0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="reflow-resize-")
    raw = os.path.join(scratch, "raw.json")
    try:
        result = run_worker(
            "resize", args.world_size, [f"--world-size={args.world_size}", f"--deep-layers={args.deep_layers}"], raw,
            {"REFLOW_BENCH_SCRATCH": scratch},
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cold = result["cold_restart_s"]
    for transition in result["transitions"]:
        transition["share_of_cold_restart"] = transition["seconds"] / cold
    result = {
        "benchmark": "resize",
        "world_size": args.world_size,
        "shard_degree": 2,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": f"python -m reflow.bench resize --world-size {args.world_size} --deep-layers {args.deep_layers}",
        **result,
        "targets": {
            "each_transition_under_5pct_of_cold_restart": all(t["share_of_cold_restart"] < 0.05 for t in result["transitions"]),
            "bucketized_at_least_5x_per_tensor": result["bucketized_vs_per_tensor"]["speedup_at_best"] >= 5.0,
        },
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(format_report(result))
    print(f"[bench] wrote {args.out}", file=sys.stderr)
    return 0


def format_report(result: dict) -> str:
    lines = [f"cold restart (checkpoint, rebuild engines and trainers, load): {result['cold_restart_s']:.2f}s"]
    for t in result["transitions"]:
        lines.append(
            f"{t['direction']:<17} {t['from']} -> {t['to']}: {t['seconds'] * 1000:.0f} ms "
            f"({100 * t['share_of_cold_restart']:.1f}% of cold), {t['bytes_moved'] / 2**20:.1f} MiB moved"
        )
    b = result["bucketized_vs_per_tensor"]
    lines.append(f"shard transfer, {b['model_layers']}-layer model, {b['tensors_per_shard']} tensors per shard:")
    for label, timing in b["timings"].items():
        lines.append(f"  {label:<10} {timing['seconds'] * 1000:8.1f} ms  {timing['broadcasts']:5d} broadcasts")
    lines.append(f"  bucketized at {b['best_bucket']}: {b['speedup_at_best']:.1f}x faster than per tensor")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
