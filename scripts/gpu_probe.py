"""What one run on a lent GPU can tell us: the memory plan's estimated terms measured, stage by stage.

    scripts/gpu_probe.sh OUT_DIR          # on the lent machine (installs gpu_wheels/ offline first)
    python3 scripts/gpu_probe.py --out probe.json [--stages a,b] [--cpu-selftest]

World size 1. Each stage runs in a child process under its own time cap, so a hang or a crash costs that stage
only; the JSON is written after every stage (a kill of the whole run keeps what finished). A stage that needs
CUDA reports SKIP with the reason on a machine without it. The stages that need torchtitan come last: on the
lent machine's own torch an import failure there costs nothing else.

  environment   torch, CUDA, the device; the CUDA context's bytes, and cuBLAS's workspace after a bf16 matmul
                (against ``reflow.memory_plan.CUDA_CONTEXT_GIB``)
  nccl          a one-rank NCCL group: the device bytes its first communicator and a second group's take
                (against ``NCCL_COMMUNICATOR_GIB``)
  logprobs      ``chunked_token_logprobs`` at vocabulary 151,936 and width 4096, forward and backward: its
                peak against the plan's log-prob workspace term
  pinned        parking Qwen3-8B's per-rank shards (8 ranks: parameters and AdamW moments, fp32) in pinned
                host memory: the allocator's rounding factor without and with ``exact_pinned_allocations``,
                park and unpark GB/s, the buffers reused, what the host cache keeps after a free and after
                ``empty_host_cache``
  block         (torchtitan) a two-layer Qwen3 at 8B width, bf16, flex attention: activation bytes per token
                with and without full activation checkpointing against the plan's; then compiled blocks over
                six widths: the graphs dynamo compiles
  fsdp          (torchtitan) the tiny recipe's FSDP2 trainer with bf16 gathers: three steps, finite losses,
                seconds per step

``--cpu-selftest`` runs every stage's code on the CPU at small shapes (figures meaningless, code paths proven):
what this machine can check before device time is spent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 1024**3
STAGES = {  # name: (seconds allowed, needs CUDA, needs torchtitan)
    "environment": (45, True, False),
    "nccl": (45, True, False),
    "logprobs": (60, True, False),
    "pinned": (90, True, False),
    "block": (150, True, True),
    "fsdp": (90, True, True),
}


# ---- stages: each returns a dict of figures, or raises ------------------------------------------------


def _device(selftest: bool):
    import torch

    return torch.device("cpu") if selftest else torch.device("cuda", 0)


def _used_bytes() -> int:
    """Device bytes in use by anything (the context included): total - free."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def stage_environment(selftest: bool) -> dict:
    import platform

    import torch

    from reflow.memory_plan import CUDA_CONTEXT_GIB

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if selftest:
        return out
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    out.update(device=props.name, total_gib=round(props.total_memory / GIB, 2), capability=f"{props.major}.{props.minor}")
    torch.zeros(1, device="cuda")
    context = _used_bytes()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with_cublas = _used_bytes() - torch.cuda.memory_reserved()
    out.update(context_gib=round(context / GIB, 3), context_and_cublas_gib=round(with_cublas / GIB, 3),
               planned_context_gib=CUDA_CONTEXT_GIB)
    return out


def stage_nccl(selftest: bool) -> dict:
    import torch
    import torch.distributed as dist

    from reflow.memory_plan import NCCL_COMMUNICATOR_GIB

    backend = "gloo" if selftest else "nccl"
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    device = _device(selftest)
    x = torch.ones(1 << 20, device=device)
    out = {"backend": backend}
    if not selftest:
        torch.cuda.synchronize()
        before = _used_bytes()
    dist.all_reduce(x)
    if not selftest:
        torch.cuda.synchronize()
        first = _used_bytes() - before
    group = dist.new_group([0])
    dist.all_reduce(x, group=group)
    if not selftest:
        torch.cuda.synchronize()
        second = _used_bytes() - before - first
        out.update(first_communicator_gib=round(first / GIB, 3), second_communicator_gib=round(second / GIB, 3),
                   planned_gib=NCCL_COMMUNICATOR_GIB, nccl_version=".".join(map(str, torch.cuda.nccl.version())))
    out["all_reduce_ok"] = bool(x[0].item() == 1.0)
    dist.destroy_process_group()
    return out


def stage_logprobs(selftest: bool) -> dict:
    import torch

    from reflow.trainer.logprobs import chunked_token_logprobs

    device = _device(selftest)
    vocab, dim, chunk = (1000, 64, 128) if selftest else (151_936, 4096, 1024)
    rows, length = (2, 256) if selftest else (1, 8192)
    head = torch.nn.Linear(dim, vocab, bias=False, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(rows, length, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, length), device=device)
    out = {"tokens": rows * length, "vocab": vocab, "chunk_tokens": chunk}
    if not selftest:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    logps = chunked_token_logprobs(hidden, targets, head, 1.0, chunk, "logged")[0]
    logps.sum().backward()
    out["finite"] = bool(torch.isfinite(logps).all().item())
    if not selftest:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        # the plan's term: t x dim x p (hidden) + c x vocab x (p + 20); here the head's bf16 gradient comes on top
        planned = rows * length * dim * 2 + chunk * vocab * 22
        head_grad = vocab * dim * 2
        out.update(peak_gib=round(peak / GIB, 3), planned_gib=round(planned / GIB, 3),
                   head_gradient_gib=round(head_grad / GIB, 3),
                   peak_over_plan=round((peak - head_grad) / planned, 3))
    return out


def _qwen3_8b_shard_sizes(shards: int) -> list[int]:
    """Bytes of each fp32 parameter shard of Qwen3-8B over ``shards`` ranks (FSDP2 pads dim 0 up)."""
    from reflow.model.recipe import load_recipe

    arch = load_recipe("qwen3_8b").architecture
    q, kv = arch.n_heads * arch.head_dim, arch.n_kv_heads * arch.head_dim
    layer = [(q, arch.dim), (kv, arch.dim), (kv, arch.dim), (arch.dim, q), (arch.hidden_dim, arch.dim),
             (arch.dim, arch.hidden_dim), (arch.hidden_dim, arch.dim), (arch.dim, 1), (arch.dim, 1),
             (arch.head_dim, 1), (arch.head_dim, 1)]
    shapes = [(arch.vocab_size, arch.dim), (arch.vocab_size, arch.dim), (arch.dim, 1)] + layer * arch.n_layers
    return [4 * -(-rows // shards) * cols for rows, cols in shapes]


def stage_pinned(selftest: bool) -> dict:
    import torch

    from reflow.distributed.host_memory import exact_pinned_allocations, release_host_cache
    from reflow.trainer.offload import HostParking

    device = _device(selftest)
    sizes = _qwen3_8b_shard_sizes(8)
    if selftest:
        sizes = [max(size // 4096, 4) for size in sizes[:40]]
    sizes = sizes * 3  # the parameters and both AdamW moments
    requested = sum(sizes)
    out = {"storages": len(sizes), "requested_gib": round(requested / GIB, 3)}

    def owned() -> int:
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if not selftest else 0

    def empty():
        if not selftest:
            release_host_cache()

    # 1. the default rounding, on the shard sizes
    pin = not selftest
    base = owned()
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in sizes]
    out["default_rounding_factor"] = round((owned() - base) / requested, 3) if pin else None
    del buffers
    out["cached_after_free_gib"] = round((owned() - base) / GIB, 3) if pin else None
    empty()
    out["cached_after_empty_gib"] = round((owned() - base) / GIB, 3) if pin else None
    # 2. exact allocations, the parking round trips
    out["exact_setting_applied"] = exact_pinned_allocations()
    tensors = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
    for tensor in tensors:
        tensor.random_(0, 255)
    check = [tensor[:64].clone() for tensor in tensors[:8]]
    parking = HostParking(pin=pin)
    base = owned()
    timings = []
    for _ in range(2):
        t0 = time.perf_counter()
        parking.park("state", tensors)
        t1 = time.perf_counter()
        parking.unpark("state")
        t2 = time.perf_counter()
        timings.append((t1 - t0, t2 - t1))
    out["exact_rounding_factor"] = round((owned() - base) / requested, 3) if pin else None
    out["host_bytes_equal_requested"] = parking.host_bytes == requested
    out["bitwise_back"] = all(torch.equal(tensor[:64], before) for tensor, before in zip(tensors, check))
    out["park_gb_s"] = [round(requested / 1e9 / park, 2) for park, _ in timings]  # the first includes pinning
    out["unpark_gb_s"] = [round(requested / 1e9 / unpark, 2) for _, unpark in timings]
    return out


def stage_block(selftest: bool) -> dict:
    import dataclasses

    import torch
    from torch._dynamo.utils import counters

    from reflow.model.qwen3 import build_model_config, init_buffers
    from reflow.model.recipe import load_recipe
    from reflow.trainer.parallelize import apply_block_compile, apply_full_activation_checkpointing

    device = _device(selftest)
    recipe = load_recipe("qwen3_8b")
    arch = dataclasses.replace(recipe.architecture, n_layers=2)
    if selftest:
        arch = dataclasses.replace(arch, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=1000)
    recipe = dataclasses.replace(recipe, flavor="custom", architecture=arch)
    attention = "sdpa" if selftest else "flex"  # flex has no backward on the CPU
    dtype = torch.float32 if selftest else torch.bfloat16
    tokens = 256 if selftest else 8192
    p = 2 if dtype == torch.bfloat16 else 4
    q, kv = arch.n_heads * arch.head_dim, arch.n_kv_heads * arch.head_dim
    per_token_layer = p * (3 * arch.dim + 3 * q + 3 * kv + 4 * arch.hidden_dim)
    out = {"dim": arch.dim, "layers": arch.n_layers, "tokens": tokens, "attention": attention}

    def build(checkpointing: bool, compiled: bool):
        with torch.device("meta"):
            model = build_model_config(recipe, attention).build()
        model._skip_lm_head = True
        if checkpointing:
            apply_full_activation_checkpointing(model)
        if compiled:
            apply_block_compile(model)
        model.to_empty(device=device)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.02)
            init_buffers(model, device)
        return model.to(dtype)

    def run(model, width: int) -> int:
        inputs = torch.randint(0, arch.vocab_size, (1, width), device=device)
        masks = None
        if attention == "flex":
            positions = torch.arange(width, device=device).expand_as(inputs)
            masks = model.get_attention_masks(positions)
        if not selftest:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        hidden = model(inputs, attention_masks=masks)
        hidden.float().pow(2).mean().backward()
        if selftest:
            return 0
        torch.cuda.synchronize()
        grads = sum(param.numel() * param.element_size() for param in model.parameters())
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - base - grads

    for checkpointing in (False, True):
        model = build(checkpointing, compiled=False)
        measured = run(model, tokens)
        planned = (
            tokens * (arch.n_layers * p * arch.dim + per_token_layer) if checkpointing
            else tokens * arch.n_layers * per_token_layer
        )
        key = "full_ac" if checkpointing else "no_ac"
        out[key] = {"measured_bytes_per_token": round(measured / tokens), "planned_bytes_per_token": round(planned / tokens)}
        if not selftest:
            out[key]["measured_over_plan"] = round(measured / planned, 3)
        del model
    counters.clear()
    model = build(checkpointing=True, compiled=True)
    graphs = []
    widths = [64, 96, 200, 333, 512, 777] if selftest else [512, 1000, 2048, 3000, 4096, 6000]
    t0 = time.perf_counter()
    for width in widths:
        run(model, width)
        graphs.append(counters["stats"]["unique_graphs"])
    out["compiled"] = {"widths": widths, "unique_graphs_after_each": graphs, "seconds": round(time.perf_counter() - t0, 1)}
    return out


def stage_fsdp(selftest: bool) -> dict:
    import torch

    from reflow.config.job_config import JobConfig
    from reflow.distributed import build_trainer_layouts, init_distributed
    from reflow.model.recipe import load_recipe, resolve_path
    from reflow.trainer.batch import pack
    from reflow.trainer.policy import PolicyTrainer

    rank, world, device = init_distributed()
    recipe = load_recipe("tiny")
    cfg = JobConfig()
    cfg.training.param_dtype = "bfloat16"
    cfg.training.lr = 1e-3
    cfg.training.micro_batch_size = 4
    trainer = PolicyTrainer.from_config(
        cfg, recipe, resolve_path(recipe.hf_checkpoint), build_trainer_layouts(world, 1, [1]), 1, device,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30, (6,), generator=gen).tolist() for _ in range(8)]
    outs = [torch.randint(3, 30, (int(torch.randint(4, 40, (1,), generator=gen)),), generator=gen).tolist() for _ in range(8)]
    batch = pack(prompts, outs, [[-1.0] * len(o) for o in outs], [[0] * len(o) for o in outs],
                 [(-1.0) ** i for i in range(8)], [1.0] * 8, [0.0] * 8, 0)
    losses, seconds = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        stats = trainer.train_step(batch)
        seconds.append(round(time.perf_counter() - t0, 3))
        losses.append(stats.loss)
    return {"device": str(device), "losses": losses, "finite": all(math.isfinite(loss) for loss in losses),
            "seconds_per_step": seconds}


# ---- the driver ---------------------------------------------------------------------------------------


def _child(name: str, selftest: bool, result_path: str) -> None:
    """Run one stage in this process; write {"status", ...} to result_path."""
    t0 = time.perf_counter()
    try:
        figures = globals()[f"stage_{name}"](selftest)
        result = {"status": "PASS", **figures}
    except Exception as error:  # reported, and the driver goes on with the next stage
        result = {"status": "FAIL", "error": repr(error), "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    with open(result_path, "w") as f:
        json.dump(result, f)


def _has_cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as error:
        return False, f"torch does not import: {error}"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    return True, ""


def _has_torchtitan() -> tuple[bool, str]:
    probe = subprocess.run([sys.executable, "-c", "import torchtitan"], capture_output=True, text=True)
    if probe.returncode:
        return False, "torchtitan does not import: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
    return True, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--cpu-selftest", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.cpu_selftest, args.result)
        return 0
    names = [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = [name for name in names if name not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown {unknown} (known: {', '.join(STAGES)})")
    cuda, no_cuda = _has_cuda()
    report = {"cpu_selftest": args.cpu_selftest, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}}
    for name in names:
        limit, needs_cuda, needs_titan = STAGES[name]
        if needs_cuda and not cuda and not args.cpu_selftest:
            report["stages"][name] = {"status": "SKIP", "reason": no_cuda}
        elif needs_titan and not (titan := _has_torchtitan())[0]:
            report["stages"][name] = {"status": "SKIP", "reason": titan[1]}
        else:
            result_path = f"{args.out}.{name}.part"
            cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--child", name, "--result", result_path]
            cmd += ["--cpu-selftest"] if args.cpu_selftest else []
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            env.setdefault("OMP_NUM_THREADS", "1")
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
                if os.path.exists(result_path):
                    with open(result_path) as f:
                        report["stages"][name] = json.load(f)
                    os.remove(result_path)
                else:
                    report["stages"][name] = {"status": "FAIL", "error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
            except subprocess.TimeoutExpired:
                report["stages"][name] = {"status": "TIMEOUT", "limit_s": limit}
        print(f"{report['stages'][name]['status']:7s} {name}", flush=True)
        with open(args.out, "w") as f:  # after every stage: a kill keeps what finished
            json.dump(report, f, indent=1)
    return 0 if all(stage["status"] in ("PASS", "SKIP") for stage in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
