"""The trainer step and the weight sync against what the hardware allows, side by side in one run.

    python -m reflow.bench trainer [--out outputs/bench/trainer.json] [--steps 8] [--deep-layers 24]

  reflow_tokens_per_s       the project's trainer step (``PolicyTrainer.train_step`` under torchrun, 2 ranks,
                            FSDP2 over both, one compute thread each) on a fixed batch: 256 sequences of 20
                            tokens (10 prompt, 10 response), made-up advantages, the tiny recipe
  reflow_compiled_tokens_per_s  the same with training.compile (each block torch.compiled; the compile is
                            paid in the warm-up steps)
  plain_torch_tokens_per_s  one process, 2 threads: transformers' Qwen3 from the same checkpoint, forward,
                            token log-probs, backward and AdamW on the same tokens (the loss a plain loop
                            would write: mean of -advantage x log-prob over response tokens)
  weight_sync_s             the project's weight sync (3 ranks: 2 trainer ranks gather, one engine reloads),
                            mean over --steps syncs, for the tiny model and a --deep-layers variant (hundreds
                            of tensors)
  weight_sync_bound_s       the same bytes copied once on one rank plus the engine's reload of them

Targets: reflow_tokens_per_s at least 0.7x plain_torch_tokens_per_s; weight_sync_s at most 3x its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

from reflow.bench.launch import run_worker

SEQUENCES, PROMPT, RESPONSE = 256, 10, 10


def fixed_batch(vocab: int):
    """The benchmark's batch: (prompts, responses, advantages), the same on every rank and in every loop."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (SEQUENCES, PROMPT), generator=gen)
    responses = torch.randint(3, vocab, (SEQUENCES, RESPONSE), generator=gen)
    advantages = torch.randn(SEQUENCES, generator=gen)
    return prompts, responses, advantages


def plain_torch(hf_dir: str, steps: int) -> dict:
    """A single-process transformers loop on the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    prompts, responses, advantages = fixed_batch(model.config.vocab_size)
    tokens = torch.cat([prompts, responses], dim=1)
    times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1]).logits.float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)[:, PROMPT - 1 :]
        loss = -(advantages[:, None] * logp).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "tokens_per_s": tokens.numel() / statistics.median(times)}


def make_deep_checkpoint(hf_dir: str, layers: int, out_dir: str) -> None:
    """The tiny checkpoint's architecture with ``layers`` layers, random weights, same tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    config.num_hidden_layers = layers
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    for name in os.listdir(hf_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(hf_dir, name), os.path.join(out_dir, name))


def worker(out_path: str, steps: int, deep_dir: str, deep_layers: int) -> None:
    """3 ranks: ranks 0-1 train (FSDP2 over both), rank 2 generates."""
    import copy
    import dataclasses

    import torch
    import torch.distributed as dist

    from reflow.config.job_config import JobConfig
    from reflow.distributed import build_placement, build_trainer_layouts, init_distributed
    from reflow.model.qwen3 import build_model_config
    from reflow.model.recipe import load_recipe, resolve_path
    from reflow.rollout.engine import RolloutEngine
    from reflow.trainer.batch import pack
    from reflow.trainer.hf_io import build_adapter
    from reflow.trainer.policy import PolicyTrainer
    from reflow.weight_sync import WeightSync, build_sync_plan

    rank, world, device = init_distributed()
    torch.set_num_threads(1)
    placement = build_placement(world, 1, 2, 1)
    report: dict = {}
    for label, layers in (("tiny", None), ("deep", deep_layers)):
        cfg = JobConfig()
        cfg.training.lr = 1e-5
        cfg.training.micro_batch_size = SEQUENCES // 2  # one micro-batch per rank
        recipe = load_recipe("tiny")
        hf_dir = resolve_path(recipe.hf_checkpoint)
        if layers:
            recipe = dataclasses.replace(recipe, architecture=dataclasses.replace(recipe.architecture, n_layers=layers))
            hf_dir = deep_dir
        # the engine first: it is collective to build (every rank builds one), and building it after the previous
        # model's engine was deleted brings back the process groups vLLM's teardown took down
        engine = RolloutEngine(cfg.rollout, recipe, hf_dir, seed=rank)
        layouts = build_trainer_layouts(world, 2, [1])
        trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device) if placement.is_trainer(rank) else None
        model_cfg = build_model_config(recipe)
        plan = build_sync_plan(model_cfg, build_adapter(model_cfg, hf_dir), cfg.weight_sync.bucket_size_mb, torch.float32)
        sync = WeightSync(placement, plan, rank, device)
        entry: dict = {"tensors": sum(len(b) for b in plan.buckets), "bytes": plan.numel * 4, "buckets": len(plan.buckets)}
        if label == "tiny" and trainer is not None:
            prompts, responses, advantages = fixed_batch(recipe.architecture.vocab_size)
            mine = slice(rank * SEQUENCES // 2, (rank + 1) * SEQUENCES // 2)
            batch = pack(
                prompts[mine].tolist(), responses[mine].tolist(), [[-1.0] * RESPONSE] * (SEQUENCES // 2),
                [[0] * RESPONSE] * (SEQUENCES // 2), advantages[mine].tolist(), [1.0] * (SEQUENCES // 2),
                [0.0] * (SEQUENCES // 2), 0,
            )

            def median_step_s(policy: PolicyTrainer) -> float:
                times = []
                for step in range(steps + 2):  # two warm-up steps (and the compile, when on)
                    dist.barrier(group=policy.group)
                    t0 = time.perf_counter()
                    policy.train_step(batch)
                    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=policy.group)
                    if step >= 2:
                        times.append(elapsed.item())
                return statistics.median(times)

            entry["train_step_s"] = median_step_s(trainer)
            entry["reflow_tokens_per_s"] = SEQUENCES * (PROMPT + RESPONSE) / entry["train_step_s"]
            compiled_cfg = copy.deepcopy(cfg)
            compiled_cfg.training.compile = True
            compiled = PolicyTrainer.from_config(compiled_cfg, recipe, hf_dir, layouts, 1, device)
            entry["compiled_train_step_s"] = median_step_s(compiled)
            entry["reflow_compiled_tokens_per_s"] = SEQUENCES * (PROMPT + RESPONSE) / entry["compiled_train_step_s"]
            del compiled
        syncs = []
        for version in range(1, steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            sync.sync(trainer, engine, version)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            syncs.append(elapsed.item())
        entry["weight_sync_s"] = statistics.median(syncs)
        if placement.is_rollout(rank):  # the bound: one local copy of the same bytes, then the engine's reload of them
            flat = torch.randn(plan.numel)
            bounds = []
            for _ in range(3):
                t0 = time.perf_counter()
                copy = flat.clone()
                tensors, offset = [], 0
                for bucket in plan.buckets:
                    for _, hf_name, shape in bucket:
                        n = 1
                        for d in shape:
                            n *= d
                        tensors.append((hf_name, copy[offset : offset + n].view(shape)))
                        offset += n
                engine.load_weights(iter(tensors), version=0)
                bounds.append(time.perf_counter() - t0)
            entry["weight_sync_bound_s"] = statistics.median(bounds)
        gathered = [None] * world
        dist.all_gather_object(gathered, entry)
        merged = {}
        for part in gathered:
            merged.update(part)
        report[label] = merged
        del trainer, engine
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m reflow.bench trainer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["trainer"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--deep-layers", type=int, default=24)
    ap.add_argument("--out", default="outputs/bench/trainer.json")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deep-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.deep_dir, args.deep_layers)
        return 0
    from reflow.model.recipe import load_recipe, resolve_path

    hf_dir = resolve_path(load_recipe("tiny").hf_checkpoint)
    scratch = tempfile.mkdtemp(prefix="reflow-trainer-")
    try:
        deep_dir = os.path.join(scratch, "deep")
        make_deep_checkpoint(hf_dir, args.deep_layers, deep_dir)
        measured = run_worker(
            "trainer", 3, [f"--steps={args.steps}", f"--deep-layers={args.deep_layers}", f"--deep-dir={deep_dir}"],
            os.path.join(scratch, "raw.json"),
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    plain = plain_torch(hf_dir, args.steps)
    tiny, deep = measured["tiny"], measured["deep"]
    ratio = tiny["reflow_tokens_per_s"] / plain["tokens_per_s"]
    result = {
        "benchmark": "trainer",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "batch": {"sequences": SEQUENCES, "prompt_tokens": PROMPT, "response_tokens": RESPONSE},
        "reflow_tokens_per_s": tiny["reflow_tokens_per_s"],
        "reflow_train_step_s": tiny["train_step_s"],
        "reflow_compiled_tokens_per_s": tiny["reflow_compiled_tokens_per_s"],
        "reflow_compiled_train_step_s": tiny["compiled_train_step_s"],
        "plain_torch_tokens_per_s": plain["tokens_per_s"],
        "plain_torch_step_s": plain["step_s"],
        "reflow_vs_plain": ratio,
        "weight_sync": {
            label: {k: entry[k] for k in ("tensors", "bytes", "buckets", "weight_sync_s", "weight_sync_bound_s")}
            | {"vs_bound": entry["weight_sync_s"] / entry["weight_sync_bound_s"]}
            for label, entry in (("tiny", tiny), ("deep", deep))
        },
        "targets": {
            "reflow_vs_plain_at_least": 0.7, "reflow_vs_plain_met": ratio >= 0.7,
            "weight_sync_vs_bound_at_most": 3.0,
            "weight_sync_met": all(e["weight_sync_s"] <= 3 * e["weight_sync_bound_s"] for e in (tiny, deep)),
        },
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"trainer: reflow {result['reflow_tokens_per_s']:.0f} tok/s vs plain torch {plain['tokens_per_s']:.0f} tok/s = "
          f"{ratio:.2f}x (target >= 0.7); "
          f"compiled {result['reflow_compiled_tokens_per_s']:.0f} tok/s")
    for label, entry in result["weight_sync"].items():
        print(f"weight sync {label:5s} ({entry['tensors']} tensors, {entry['bytes'] / 2**20:.1f} MiB): "
              f"{entry['weight_sync_s'] * 1000:.1f} ms "
              f"vs bound {entry['weight_sync_bound_s'] * 1000:.1f} ms = {entry['vs_bound']:.1f}x (target <= 3)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
