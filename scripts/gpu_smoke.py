"""The GPU path on one GPU, stage by stage: PASS or FAIL for each, exit status 1 if any failed.

    scripts/gpu_smoke.sh        # torchrun --nproc-per-node 1 scripts/gpu_smoke.py

Trainer stages (always; a lent machine has torch and can carry torchtitan's wheel, not vLLM's):
  cuda        a CUDA device, and the default group on NCCL
  train       the tiny recipe's FSDP2 trainer in bf16 gathers, torch.compile'd blocks and full activation
              checkpointing: three steps, finite losses, the weights moved
  offload     parking the parameters and AdamW state frees their bytes on the device; unparking brings them
              back bitwise
  plan        the memory plan's train phase for the tiny recipe on this GPU against the measured peak of a step
  gather      the weight sync's bucketed gather: every tensor of every bucket equals the parameter, in bf16
Engine stages (when vLLM is importable):
  sync-mode   five steps of train_configs/tiny.toml in sync mode with the engine on the GPU
  sleep-wake  the engine's sleep frees device memory and its wake takes it back
  weights     after a sync, the engine's weights equal the trainer's in bf16
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS: list[tuple[str, bool, str]] = []


def stage(name: str):
    def run(body):
        t0 = time.time()
        try:
            detail = body() or ""
            RESULTS.append((name, True, detail))
            print(f"PASS {name} ({time.time() - t0:.1f}s) {detail}", flush=True)
        except Exception as error:  # a stage's failure is reported, and the next stage runs
            RESULTS.append((name, False, repr(error)))
            print(f"FAIL {name} ({time.time() - t0:.1f}s) {error!r}", flush=True)
            traceback.print_exc(file=sys.stderr)
        return body

    return run


def _trainer_hf(trainer) -> dict:
    """The trainer's parameters, whole, under their Hugging Face names, in bf16 on the host."""
    full = {name: tensor.full_tensor().detach() for name, tensor in trainer.model.state_dict().items()}
    return {name: tensor.to("cpu", dtype=__import__("torch").bfloat16) for name, tensor in trainer.adapter.to_hf(full).items()}


def main() -> int:
    import torch
    import torch.distributed as dist

    from reflow.config.job_config import JobConfig
    from reflow.distributed import build_trainer_layouts, init_distributed
    from reflow.memory_plan import GIB, memory_plan
    from reflow.model.recipe import load_recipe, resolve_path
    from reflow.trainer.batch import pack

    state: dict = {}

    @stage("cuda")
    def _():
        assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
        rank, world, device = init_distributed()
        assert world == 1 and device.type == "cuda", (world, device)
        assert dist.get_backend() in ("nccl", "cpu:gloo,cuda:nccl"), dist.get_backend()
        state["device"] = device
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / GIB:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}"

    if "device" not in state:
        print("FAIL: cuda (the other stages need a CUDA device)", flush=True)
        return 1
    device = state["device"]
    recipe = load_recipe("tiny")
    hf_dir = resolve_path(recipe.hf_checkpoint)
    cfg = JobConfig()
    training = cfg.training
    training.param_dtype, training.compile, training.activation_checkpointing = "bfloat16", True, "full"
    training.offload_while_generating, training.micro_batch_size = True, 8
    cfg.rollout.max_model_len = 64
    layouts = build_trainer_layouts(1, 1, [1])
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, 30, (8,), generator=gen).tolist(), torch.randint(3, 30, (40,), generator=gen).tolist())
            for _ in range(16)]
    batch = pack([p for p, _ in rows], [o for _, o in rows], [[-3.0] * 40] * 16, [[0] * 40] * 16, [1.0, -1.0] * 8,
                 [1.0] * 16, [0.0] * 16, 0)

    @stage("train")
    def _():
        from reflow.trainer.policy import PolicyTrainer

        trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
        state["trainer"] = trainer
        before = {n: p.to_local().detach().float().clone() for n, p in trainer.model.named_parameters()}
        losses = [trainer.train_step(batch).loss for _ in range(3)]
        assert all(torch.isfinite(torch.tensor(losses))), losses
        moved = max((p.to_local().detach().float() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters())
        assert moved > 0, "no weight moved"
        return f"losses {', '.join(f'{x:.4f}' for x in losses)}; largest weight change {moved:.2e}"

    @stage("offload")
    def _():
        trainer = state["trainer"]
        checksum = sum(p.to_local().double().sum().item() for p in trainer.model.parameters())
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        parked = trainer.park("optimizer", "parameters")
        torch.cuda.synchronize()
        freed = allocated - torch.cuda.memory_allocated()
        assert parked > 0 and freed >= 0.9 * parked, (parked, freed)
        trainer.unpark()
        again = sum(p.to_local().double().sum().item() for p in trainer.model.parameters())
        assert again == checksum, (checksum, again)
        return f"parked {parked / 2**20:.1f} MiB, freed {freed / 2**20:.1f} MiB, restored bitwise"

    @stage("plan")
    def _():
        from reflow.distributed.placement import build_placement

        trainer = state["trainer"]
        on_gpu = dataclasses.replace(recipe, device="cuda")
        total = torch.cuda.get_device_properties(device).total_memory
        cfg.placement.gpu_memory_gib = total / GIB
        plan = memory_plan(cfg, on_gpu, build_placement(1, 1, 1, 0))
        train_phase = plan.roles[0].phases[1]
        planned = train_phase.bytes - next(t.bytes for t in train_phase.terms if t.name == "engine asleep")
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(batch)
        measured = torch.cuda.max_memory_allocated()
        # the plan is an upper bound of what the trainer's own tensors take (every micro-batch at max_model_len);
        # cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG, 32 MiB per handle on Hopper by default) comes from the
        # caching allocator on the first GEMM and dwarfs a tiny model's tensors: the plan counts it in the CUDA
        # context's reserve, not the trainer's term, so it is allowed on top
        workspace = 32 * 2**20  # one handle: one stream here
        assert measured <= 1.25 * planned + workspace, (measured, planned)
        return f"planned {planned / 2**20:.1f} MiB, measured peak {measured / 2**20:.1f} MiB ({measured / planned:.2f}x)"

    @stage("gather")
    def _():
        from reflow.distributed.placement import build_placement
        from reflow.weight_sync.broadcast import WeightSync, build_sync_plan

        trainer = state["trainer"]
        plan = build_sync_plan(trainer.model_config, trainer.adapter, bucket_size_mb=0.5, dtype=torch.bfloat16)
        sync = WeightSync(build_placement(1, 1, 1, 0), plan, 0, device)
        hf = _trainer_hf(trainer)
        seen = 0
        for name, tensor in sync._stream(trainer):
            assert torch.equal(tensor.cpu(), hf[name]), name
            seen += 1
        assert seen == len(hf), (seen, len(hf))
        return f"{seen} tensors in {len(plan.buckets)} buckets, equal to the parameters in bf16"

    try:
        import vllm  # noqa: F401

        has_vllm = True
    except ImportError:
        has_vllm = False
        print("SKIP sync-mode, sleep-wake, weights: vLLM is not importable here (the trainer stages ran)", flush=True)

    if has_vllm:
        @stage("sync-mode")
        def _():
            out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "reflow_gpu_smoke")
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "TORCHELASTIC", "GROUP_"))}
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "reflow.train",
                 "--config", "train_configs/tiny.toml", "--training.steps=5", f"--job.dump_folder={out}",
                 "--checkpoint.enable=false", "--checkpoint.export_hf=false", "--training.param_dtype=bfloat16"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            rows = [line for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
            assert len(rows) == 5, len(rows)
            return "5 steps"

        @stage("sleep-wake")
        def _():
            from reflow.rollout.engine import RolloutEngine

            trainer = state["trainer"]
            trainer.park("optimizer", "parameters")
            engine = RolloutEngine(cfg.rollout, recipe, hf_dir, seed=0)
            state["engine"] = engine
            torch.cuda.synchronize()
            free_awake = torch.cuda.mem_get_info()[0]
            engine.sleep()
            free_asleep = torch.cuda.mem_get_info()[0]
            engine.wake_up()
            free_again = torch.cuda.mem_get_info()[0]
            assert free_asleep > free_awake and free_again < free_asleep, (free_awake, free_asleep, free_again)
            return (f"sleep freed {(free_asleep - free_awake) / 2**20:.0f} MiB, "
                    f"wake took {(free_asleep - free_again) / 2**20:.0f} MiB")

        @stage("weights")
        def _():
            from reflow.distributed.placement import build_placement
            from reflow.weight_sync.broadcast import WeightSync, build_sync_plan

            trainer, engine = state["trainer"], state["engine"]
            trainer.unpark()
            trainer.train_step(batch)  # new weights, so the sync must move them
            engine.sleep(discard_weights=True)  # as sync mode before a sync: level 2, the weights dropped
            plan = build_sync_plan(trainer.model_config, trainer.adapter, bucket_size_mb=64, dtype=torch.bfloat16)
            WeightSync(build_placement(1, 1, 1, 0), plan, 0, device).sync(trainer, engine, 1)
            engine.wake_up()
            loaded = dict(engine.llm.collective_rpc(lambda worker: {
                n: p.detach().cpu() for n, p in worker.model_runner.model.named_parameters()})[0])
            expected = _trainer_hf(trainer)
            # vLLM fuses q/k/v and gate/up into one matrix each
            fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
            for name in loaded:
                for joined, parts in fused.items():
                    if joined in name and all(name.replace(joined, part) in expected for part in parts):
                        expected[name] = torch.cat([expected[name.replace(joined, part)] for part in parts])
            compared = [n for n in loaded if n in expected and loaded[n].shape == expected[n].shape]
            assert len(compared) == len(loaded), sorted(set(loaded) - set(compared))[:5]
            unequal = [n for n in compared if not torch.equal(loaded[n].to(torch.bfloat16), expected[n])]
            assert not unequal, unequal[:5]
            return f"all {len(compared)} engine tensors equal the trainer's in bf16"

    failed = [name for name, ok, _ in RESULTS if not ok]
    print(("FAIL: " + ", ".join(failed)) if failed else f"PASS: all {len(RESULTS)} stages", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
