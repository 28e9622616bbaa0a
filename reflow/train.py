"""ReFlow entry point.

    torchrun --nproc-per-node N -m reflow.train --config train_configs/tiny.toml [--section.key=value ...]
    python -m reflow.train --config train_configs/qwen3_8b.toml --dry-run     # the resolved config and memory plan
    WORLD_SIZE=N python -m reflow.train --config ... --check  # what the launchers run before torchrun (without
                                                               # WORLD_SIZE: the world the placement plans)

Bad input (config, placement, data files, model folder, checkpoint) is one line naming the file and key,
and exit code 2, before any rank builds anything.

Build order (every rank, same order: engine and mesh construction are collective):
  1. config: TOML + overrides, validated against the world size and the model recipe; from here on SIGTERM and
     SIGUSR1 are recorded, to stop the run after a step (``reflow.stopping``)
  2. distributed: default process group, placement, trainer mesh and group
  3. rollout engine: this rank's embedded vLLM engine
  4. trainer: FSDP2 policy shard + optimizer (trainer ranks)
  5. weight sync plan and process group
  6. task, tokenizer, data, metrics, checkpoints
then the chosen mode runs its loop, and the final policy is exported in HF format.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from reflow.config import ConfigError, ConfigManager, JobConfig, format_config
from reflow.config.manager import config_to_dict
from reflow.config.validate import mode_warnings, parse_schedule, validate, validate_recipe, validate_world
from reflow.distributed.placement import feasible_placements
from reflow.memory_plan import memory_plan
from reflow.model.recipe import load_recipe, resolve_path
from reflow.process_lifetime import exit_now, freeze_startup_objects
from reflow.run_record import check_dump_folder, clear_stop, record_stop, write_record
from reflow.stopping import StopSignals

logger = logging.getLogger("reflow")


def hf_checkpoint_key(cfg: JobConfig, recipe, where=lambda key: "config") -> str:
    """Where the checkpoint is named, for its errors: the config's model.hf_checkpoint, else the recipe's."""
    return (
        f"{where('model.hf_checkpoint')}: model.hf_checkpoint" if cfg.model.hf_checkpoint
        else f"{recipe.path}: [recipe] hf_checkpoint"
    )


def resolve_hf_dir(cfg: JobConfig, recipe, where=lambda key: "config") -> str:
    """The checkpoint folder: a local path, or a hub id's snapshot in the Hugging Face cache (``reflow.hub``)."""
    from reflow.hub import resolve_model

    return resolve_model(cfg.model.hf_checkpoint or recipe.hf_checkpoint, hf_checkpoint_key(cfg, recipe, where))


def dry_run(cfg: JobConfig, manager: ConfigManager) -> int:
    """Validate everything that can be checked without starting ranks; print the resolved config."""
    from reflow.model.qwen3 import build_model_config, build_on_meta, check_architecture, count_params

    world = int(os.environ.get("WORLD_SIZE", "0")) or _planned_world_size(cfg)
    placement = validate_world(cfg, world, manager.where)
    schedule = parse_schedule(cfg, placement, manager.where) if cfg.placement.schedule else []
    recipe = load_recipe(cfg.model.recipe)
    warnings = validate_recipe(cfg, recipe, placement, manager.where) + mode_warnings(cfg, manager.where)
    model_cfg = build_model_config(recipe, cfg.model.attention)
    diffs = check_architecture(recipe, model_cfg)
    if diffs:
        raise ConfigError(f"{recipe.path}: [architecture] disagrees with torchtitan: {'; '.join(diffs)}")
    n = count_params(build_on_meta(model_cfg))
    if n != recipe.num_params:
        raise ConfigError(f"{recipe.path}: [recipe] num_params = {recipe.num_params}, but the model has {n}")
    from reflow.hub import is_hub_id

    hf_dir = cfg.model.hf_checkpoint or recipe.hf_checkpoint
    if is_hub_id(hf_dir):  # (a dry run downloads nothing)
        warnings.append(f"checkpoint {hf_dir} is a Hugging Face hub id: fetched into the hub cache at start-up")
    else:
        hf_dir = resolve_path(hf_dir)
        if not os.path.isdir(hf_dir):
            warnings.append(f"checkpoint folder {hf_dir} not found on this machine (needed to train)")
    plan = memory_plan(cfg, recipe, placement)
    warnings += [f"memory: {problem}" for problem in plan.problems]
    print(format_config(cfg))
    print(plan.format())
    print(
        json.dumps(
            {
                "placement": placement.describe(),
                "feasible_placements": [
                    p.name for p in feasible_placements(world, placement.shard_degree, placement.colocated, placement.rollout_tp)
                ],
                "placement_schedule": [{"after_step": step, "trainer_replicas": replicas} for step, replicas in schedule],
                "recipe": recipe.path,
                "num_params": n,
                "trainer_param_bytes_per_rank": 4 * n // placement.shard_degree,
                "memory_plan": plan.as_dict(),
                "hf_checkpoint": hf_dir,
                "warnings": warnings,
            },
            indent=2,
        )
    )
    return 0


def check_memory(cfg: JobConfig, recipe, placement, where) -> None:
    """Refuse a run whose memory plan does not fit the recipe's device: one line, the term and the knob."""
    plan = memory_plan(cfg, recipe, placement)
    if plan.problems:
        raise ConfigError(f"{where('placement')}: with {recipe.path} on {placement.name}, {plan.problems[0]}"
                          + (f" (and {len(plan.problems) - 1} more: see --dry-run)" if len(plan.problems) > 1 else ""))


def visible_gpus() -> int:
    """GPUs this process may use, counted without initializing CUDA (which would fix the visible devices before
    ``pin_local_gpu`` chose them): CUDA_VISIBLE_DEVICES if set, else the /dev/nvidiaN devices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip()])
    return (
        len([name for name in os.listdir("/dev") if name.startswith("nvidia") and name[6:].isdigit()]) if os.path.isdir("/dev")
        else 0
    )


def check_gpus(cfg: JobConfig, recipe, where) -> None:
    """Before anything is read or fetched: a CUDA recipe needs a GPU on this node, and one per rank unless
    placement.allow_shared_gpu says otherwise (counted without initializing CUDA; ``check_cuda`` asks torch
    once the rank's device is pinned)."""
    if recipe.device != "cuda":
        return
    gpus = visible_gpus()
    if not gpus:
        raise ConfigError(
            f"{recipe.path}: [recipe] device = 'cuda', but this machine shows no GPU (no /dev/nvidiaN device, or an "
            "empty CUDA_VISIBLE_DEVICES), and a GPU recipe does not fall back to CPU: run it on a GPU node, or pick a "
            "CPU recipe such as model.recipe = 'tiny'"
        )
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_ranks > gpus and not cfg.placement.allow_shared_gpu:
        raise ConfigError(
            f"{where('placement.allow_shared_gpu')}: {local_ranks} ranks on this node but {gpus} GPU(s): each "
            "rank's engine and trainer plan on a whole device; start one rank per GPU (torchrun --nproc-per-node), "
            "or set placement.allow_shared_gpu = true"
        )


def check_cuda(recipe) -> None:
    """A recipe that names CUDA runs on CUDA: no silent fall-back to CPU and gloo. (After ``pin_local_gpu``:
    asking torch initializes CUDA.)"""
    if recipe.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"{recipe.path}: [recipe] device = 'cuda', but torch sees no usable CUDA device on this GPU node "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}; check the driver and CUDA_VISIBLE_DEVICES), "
            "and a GPU recipe does not fall back to CPU: run it on a GPU node, or pick a CPU recipe such as model.recipe = 'tiny'"
        )


def _planned_world_size(cfg: JobConfig) -> int:
    p = cfg.placement
    if p.trainer_shard_degree > 0:
        return p.trainer_replicate_degree * p.trainer_shard_degree + p.num_rollout_ranks
    return p.trainer_replicate_degree + p.num_rollout_ranks


def pin_local_gpu(rollout_tp: int) -> None:
    """Give each torchrun rank exactly its own GPU before anything touches CUDA.

    vLLM's in-process executor places its engine on the current process's first visible device, whatever
    torch.cuda.set_device said; with one visible device per rank the trainer and the engine agree. A
    tensor-parallel engine (external_launcher) places each rank on device LOCAL_RANK and its all-reduces
    need the block's devices visible, so with rollout.tensor_parallel_degree > 1 every device stays visible
    (the trainer also uses device LOCAL_RANK)."""
    local = os.environ.get("LOCAL_RANK")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if local is None or rollout_tp > 1 or os.environ.get("REFLOW_KEEP_VISIBLE_DEVICES") == "1":
        return
    if visible:
        devices = [d for d in visible.split(",") if d.strip()]
        if len(devices) > 1:
            os.environ["CUDA_VISIBLE_DEVICES"] = devices[int(local) % len(devices)]
    elif os.path.exists("/dev/nvidia0"):
        os.environ["CUDA_VISIBLE_DEVICES"] = local


def check_inputs(cfg: JobConfig, recipe, where) -> tuple[list, list]:
    """Everything the config points at, read before any rank starts: the Hugging Face folder (weights, config,
    tokenizer), the task and its data files (every row), and the checkpoint a resume would load. Returns the
    train and eval problems."""
    from reflow.checkpoint import CheckpointManager
    from reflow.rewards import RewardMix
    from reflow.tasks import build_task, load_problems
    from reflow.trainer.hf_io import check_hf_dir

    hf_dir = resolve_hf_dir(cfg, recipe, where)
    check_hf_dir(hf_dir, hf_checkpoint_key(cfg, recipe, where))
    if cfg.lora.enabled and cfg.lora.adapter:  # the adapter folder a LoRA run starts from, against this model
        from reflow.model.qwen3 import build_model_config
        from reflow.trainer.hf_io import build_adapter
        from reflow.trainer.lora import build_adapter_plan, check_adapter_folder

        model_cfg = build_model_config(recipe, cfg.model.attention)
        plan = build_adapter_plan(model_cfg, build_adapter(model_cfg, hf_dir), cfg.lora, hf_dir)
        check_adapter_folder(resolve_path(cfg.lora.adapter), plan, cfg.lora, f"{where('lora.adapter')}: lora.adapter")
    try:  # (an agent task imports its agent here: a bad task.agent is named before any rank starts)
        task = build_task(cfg.task)
    except ValueError as error:
        raise ValueError(f"{where('task.agent' if cfg.task.name == 'agent' else 'task.name')}: {error}") from None
    try:
        RewardMix.build(task, cfg.reward, cfg.rollout.max_new_tokens)
    except ValueError as error:
        raise ValueError(f"{where('reward.functions')}: {error}") from None
    train_problems = load_problems(resolve_path(cfg.task.train_file), f"{where('task.train_file')}: task.train_file")
    eval_problems = load_problems(resolve_path(cfg.task.eval_file), f"{where('task.eval_file')}: task.eval_file")
    chat_rows = next((p for p in train_problems + eval_problems if p.messages is not None), None)
    if cfg.task.chat or chat_rows is not None:
        from transformers import AutoTokenizer

        if not AutoTokenizer.from_pretrained(hf_dir).chat_template:
            why = (
                f"{where('task.chat')}: task.chat = true" if cfg.task.chat
                else f"row {chat_rows.uid} of the task data is chat messages"
            )
            raise ValueError(f"{why}, but the tokenizer in {hf_dir} has no chat template")
    CheckpointManager(cfg.checkpoint, cfg.job.dump_folder).check()
    return train_problems, eval_problems


def build_components(
    cfg: JobConfig, recipe, placement, schedule: list[tuple[int, int]], warnings: list[str], problems: tuple[list, list],
    stop_signals: StopSignals,
):
    """Build every rank's components. ``recipe``, ``placement``, ``schedule`` (placement.schedule parsed),
    ``warnings`` and the (train, eval) ``problems`` come from the checks ``main`` ran before any rank started
    building; ``stop_signals`` is the handler ``main`` installed before that."""
    import torch

    from reflow.checkpoint import CheckpointManager
    from reflow.config.mode_settings import resolve_settings
    from reflow.distributed import build_trainer_layouts, init_distributed
    from reflow.metrics import MetricsLogger
    from reflow.metrics.timeline import NullTimeline, Timeline
    from reflow.modes.base import Components
    from reflow.rewards import RewardMix
    from reflow.rollout.engine import AdapterSlots, RolloutEngine
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.serving.drivers import AgentServing, new_driver
    from reflow.tasks import build_task
    from reflow.trainer.lora import build_adapter_plan
    from reflow.trainer.policy import PolicyTrainer
    from reflow.weight_sync import WeightSync, build_sync_plan
    from reflow.weight_sync.adapters import AdapterSync

    # 1. the inputs ``check_inputs`` read, and the reward of the [reward] section
    hf_dir = resolve_hf_dir(cfg, recipe)
    task = build_task(cfg.task)
    rewards = RewardMix.build(task, cfg.reward, cfg.rollout.max_new_tokens)
    train_problems, eval_problems = problems
    # 2. distributed
    rank, world, device = init_distributed(cfg.job.collective_timeout_s)
    assert world == placement.world_size, "the placement was validated against torchrun's WORLD_SIZE"
    for w in warnings:
        if rank == 0:
            logger.warning(w)
    torch.manual_seed(cfg.job.seed)
    pinned = None
    if device.type == "cpu":
        if cfg.job.cpu_affinity:
            # each rank on its own core with one compute thread: a waiting rank is really idle, as on a GPU
            cores = sorted(os.sched_getaffinity(0))
            pinned = cores[int(os.environ.get("LOCAL_RANK", rank)) % len(cores)]
            os.sched_setaffinity(0, {pinned})
            torch.set_num_threads(1)
        else:
            # ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # every feasible placement's trainer layout: meshes and groups are collective to build, so every placement a
    # controller may choose exists from now on
    feasible = feasible_placements(world, placement.shard_degree, placement.colocated, placement.rollout_tp)
    replica_counts = [p.replicate_degree for p in feasible]
    layouts = build_trainer_layouts(world, placement.shard_degree, replica_counts)
    trainer_group = layouts[placement.replicate_degree].group
    log = MetricsLogger(
        cfg.job.dump_folder, rank == 0, cfg.training.steps, cfg.metrics.enable_tensorboard, cfg.metrics.enable_progress_bar,
        plain_every=cfg.metrics.progress_every, wandb=cfg.metrics.wandb_settings(), config=config_to_dict(cfg),
    )
    log.info(f"{placement.describe()}; mode {cfg.training.mode}; model {recipe.name} from {hf_dir}")
    log.info(f"feasible placements with trainer shard degree {placement.shard_degree}: {', '.join(p.name for p in feasible)}")
    if pinned is not None:
        log.info(f"CPU affinity: rank {rank} pinned to core {pinned}, 1 compute thread")
    # 3. the embedded vLLM engine (every rank, same point)
    t0 = time.time()
    # the ranks of one tensor-parallel engine share its seed: their scheduler copies must sample alike
    # sync mode with a sync every few steps sleeps its engines at level 1 again and again: the pinned weight
    # backup is worth keeping cached between sleeps (elsewhere a wake releases it)
    # a LoRA run's engines serve the base with an adapter per policy version: the newest and every one a
    # trainable trajectory may still be on (the mode's bound on a sample's oldest token)
    if cfg.training.mode == "sync":
        staleness = 0
    else:
        settings = resolve_settings(cfg)
        staleness = settings.max_head_lag or settings.delta
    engine = RolloutEngine(
        cfg.rollout, recipe, hf_dir, seed=cfg.job.seed + rank // cfg.rollout.tensor_parallel_degree,
        keeps_weight_backup=cfg.training.mode == "sync" and cfg.weight_sync.interval > 1,
        adapters=AdapterSlots(cfg.lora.rank, staleness + 1) if cfg.lora.syncs_adapters else None,
    )
    if cfg.lora.syncs_adapters and cfg.lora.adapter:  # the policy at version 0: the base with that adapter
        engine.load_adapter(resolve_path(cfg.lora.adapter), 0)
    log.info(f"vLLM engines built in {time.time() - t0:.1f}s")
    if device.type == "cpu":
        log.info("CPU run: vLLM sleep/wake and trainer offload are no-ops")
    # 4. trainer shard
    # (every rank in the decoupled modes, whose placement may change: a rank outside the starting trainer holds
    # only the FSDP skeletons of the placements it may join, no storage). A rank that trains puts its engine to
    # sleep first: the engine took its share of the device when it was built, and the trainer's state is
    # allocated into what that leaves (sync mode's first generation wakes it, with the state parked)
    if placement.is_trainer(rank):
        engine.sleep()
    trainer = None
    if placement.is_trainer(rank) or not placement.colocated:
        trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, placement.replicate_degree, device)
    # 5. weight sync (every rank derives the same plan)
    from reflow.model.qwen3 import build_model_config
    from reflow.trainer.hf_io import build_adapter

    model_cfg = build_model_config(recipe, cfg.model.attention)
    sync_dtype = torch.float32 if device.type == "cpu" else getattr(torch, recipe.vllm.dtype)
    weight_syncs = {}
    if cfg.lora.syncs_adapters:  # a LoRA run: the adapters only, as a new version in every engine
        adapter_plan = build_adapter_plan(model_cfg, build_adapter(model_cfg, hf_dir), cfg.lora, hf_dir, sync_dtype)
        for there in feasible:  # the same order on every rank: new_group inside
            weight_syncs[there.replicate_degree] = AdapterSync(there, adapter_plan, rank, device)
    else:
        plan = build_sync_plan(model_cfg, build_adapter(model_cfg, hf_dir), cfg.weight_sync.bucket_size_mb, sync_dtype)
        for there in feasible:  # the same order on every rank: new_group inside
            weight_syncs[there.replicate_degree] = WeightSync(there, plan, rank, device)
    weight_sync = weight_syncs[placement.replicate_degree]
    # 6. the rest
    tokenizer = PromptTokenizer(hf_dir, cfg.task.chat)
    agents = AgentServing.start(task, tokenizer, recipe.name, cfg.rollout)  # an agent task: this rank's endpoint
    return Components(
        cfg=cfg,
        rank=rank,
        world_size=world,
        device=device,
        placement=placement,
        trainer=trainer,
        trainer_group=trainer_group,
        engine=engine,
        turns=new_driver(engine, task, tokenizer, cfg.task.tool_workers, rewards, agents),
        agents=agents,
        weight_sync=weight_sync,
        task=task,
        rewards=rewards,
        tokenizer=tokenizer,
        train_problems=train_problems,
        eval_problems=eval_problems,
        logger=log,
        timeline=(Timeline(cfg.job.dump_folder, rank, "colocated" if placement.colocated else
                           "trainer" if placement.is_trainer(rank) else "rollout")
                  if cfg.metrics.timeline else NullTimeline()),
        checkpoints=CheckpointManager(cfg.checkpoint, cfg.job.dump_folder),
        layouts=layouts,
        weight_syncs=weight_syncs,
        schedule=schedule,
        stop_signals=stop_signals,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[reflow %(levelname)s] %(message)s")
    manager = ConfigManager()
    try:
        cfg = manager.parse_args(argv)
        validate(cfg, manager.where)
        if manager.dry_run:
            return dry_run(cfg, manager)
        # the placement against torchrun's world size, before any rank builds anything; --check outside torchrun
        # (a login node, the launchers) takes the world the placement plans, as --dry-run does
        planned = _planned_world_size(cfg) if manager.check_only else 1
        placement = validate_world(cfg, int(os.environ.get("WORLD_SIZE", "0")) or planned, manager.where)
        schedule = parse_schedule(cfg, placement, manager.where) if cfg.placement.schedule else []
        recipe = load_recipe(cfg.model.recipe)
        warnings = validate_recipe(cfg, recipe, placement, manager.where) + mode_warnings(cfg, manager.where)
        check_memory(cfg, recipe, placement, manager.where)
        if not manager.check_only:  # (--check also runs where the job is submitted, which may have no GPU)
            check_gpus(cfg, recipe, manager.where)
        problems = check_inputs(cfg, recipe, manager.where)
        from reflow.checkpoint import CheckpointManager

        resume_step = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder).resume_step()
        record = check_dump_folder(cfg, resumes=resume_step is not None)
    except (ConfigError, ValueError) as e:
        if int(os.environ.get("RANK", "0")) == 0:  # one line per run, not one per rank
            print(f"reflow: config error: {e}", file=sys.stderr)
        return 2
    if manager.check_only:
        print(f"reflow: {manager.config_file or 'defaults'}: config, placement ({placement.name}), data, model and "
              f"checkpoint OK for {placement.world_size} ranks")
        return 0

    pin_local_gpu(cfg.rollout.tensor_parallel_degree)
    try:
        check_cuda(recipe)
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"reflow: config error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from reflow.modes.registry import MODES

    # SIGTERM / SIGUSR1 stop the run after the current step (reflow.stopping), from now on: a signal while the
    # rank loads its model and engine (minutes for a large one) is recorded, not fatal, and the run stops, with a
    # checkpoint, after its first step
    stop_signals = StopSignals().install()
    parts = build_components(cfg, recipe, placement, schedule, warnings, problems, stop_signals)
    freeze_startup_objects()  # what start-up made lives as long as the rank (reflow.process_lifetime)
    if parts.rank == 0:  # what produced this run, kept with it (a resume appends itself)
        write_record(cfg, record, resume_step)
        clear_stop(cfg)
    mode = MODES[cfg.training.mode](parts)
    t0 = time.time()
    mode.run()
    ran = f"trained {mode.step} of {cfg.training.steps} steps" if mode.step < cfg.training.steps else f"trained {mode.step} steps"
    parts.logger.info(f"{ran} in {time.time() - t0:.1f}s; metrics in {cfg.job.dump_folder}/metrics.jsonl")
    code = 0
    if mode.stopped_by == "non-finite updates":
        if parts.rank == 0:
            print(f"reflow: training stopped after step {mode.step}: {mode.diverged}", file=sys.stderr)
        code = 1
    elif mode.stopped_by not in (None, "time budget"):
        where = f"a checkpoint of step {mode.step} is in {parts.checkpoints.folder}" if cfg.checkpoint.enable else (
            "checkpoint.enable is false: nothing to resume from")
        parts.logger.info(f"stopped by {mode.stopped_by} after step {mode.step}; {where}; run the same command to resume")
        if parts.rank == 0:  # for a batch script: exit 0 (and requeue at the time limit) whatever torchrun returns
            record_stop(cfg, mode.stopped_by, mode.step, cfg.checkpoint.enable)
    if (
        code == 0 and mode.stopped_by in (None, "time budget") and cfg.checkpoint.export_hf and parts.trainer is not None
        and parts.trainer.active
    ):
        out = os.path.join(cfg.job.dump_folder, "hf_final")
        parts.trainer.export_hf(out)
        parts.logger.info(f"exported the policy in Hugging Face format to {out}")
        if parts.trainer.lora is not None and not (cfg.lora.train_embeddings or cfg.lora.train_head):
            adapters = os.path.join(cfg.job.dump_folder, "adapter_final")
            parts.trainer.export_adapter(adapters)
            parts.logger.info(f"exported the LoRA adapters in peft format to {adapters} (base: {parts.trainer.hf_dir})")
    parts.logger.close()
    parts.timeline.close()
    if parts.agents is not None:  # the agents' process: its endpoint and agents (no episode is left by now)
        parts.agents.close()
    dist.barrier()
    # vLLM's exit hook tears down its own process groups; it needs the default group alive then
    return code


if __name__ == "__main__":
    exit_now(main())  # (reflow.process_lifetime: a finished rank skips Python's finalization)
