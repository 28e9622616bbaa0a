"""A config that has not run, in the simulator: ``python -m reflow.sim predict --config X``.

Every setting the simulator models is read from the config itself, in one place (``sim_config``): the mode,
the batch (prompts x group size), the placement (trainer replicas and shard degree, rollout ranks: the world
is their sum, or ``--world``), sigma, tau, delta, the strict window, the weight-sync interval, B_max, the
scheduler's parts (adaptive concurrency, KV admission and its rho and response percentile, adaptive
placement with its cooldown, margin and horizon), dynamic sampling, the seed, and the engines' limits (KV
blocks, block size, max_num_seqs: ``with_engine_settings``). What the config cannot say comes from a cost
profile: a named one (``--profile``) or one fitted from a run's metrics (``--fit``), whose costs stay its own.
The workload is the task's train file where its rows are chain_sum-style text (prompt and answer strings,
the tiny tokenizer's lengths), else a named workload (``--workload``).

The prediction: tokens/s, loss-weighted tokens/s, fresh samples/s, trainer idle (wait and sync stall apart),
rollout idle, replay fraction and the evicted fraction, past the warm-up steps.
"""

from __future__ import annotations

import json
import os

from reflow.config.job_config import JobConfig
from reflow.sim.profiles import CostProfile, with_engine_settings
from reflow.sim.system import SimConfig, simulate_seeds
from reflow.sim.workload import REASONING_DRIFT, Workload, chain_sum_workload

PREDICTED = (
    "tokens_per_s", "loss_tokens_per_s", "fresh_samples_per_s", "trainer_idle_ratio", "trainer_wait_ratio",
    "sync_stall_ratio", "rollout_idle_ratio", "replay_fraction", "evicted_fraction",
)
"""What ``predict`` reports, under the live step rows' and the modes benchmark's names."""

WORKLOADS = {"reasoning-drift": REASONING_DRIFT}


def world_of(cfg: JobConfig) -> int | None:
    """The world the config's placement names (trainer replicas x shard degree + rollout ranks), or None when its
    shard degree is -1 ("all remaining ranks": the world is torchrun's to say)."""
    p = cfg.placement
    if p.trainer_shard_degree < 1:
        return None
    return p.trainer_replicate_degree * p.trainer_shard_degree + p.num_rollout_ranks


def sim_config(cfg: JobConfig, world: int, steps: int, warmup_steps: int, mode: str | None = None,
               rollout_ranks: int | None = None) -> SimConfig:
    """The simulation of ``cfg`` on ``world`` ranks (in ``mode``, default the config's own: the bench runs every
    mode on one config; with ``rollout_ranks`` instead of the placement's, as the bench sets them). Sync is
    colocated and on-policy: every rank trains and generates, one sync a step."""
    mode = mode or cfg.training.mode
    p, replay, scheduler = cfg.placement, cfg.replay, cfg.scheduler
    if mode == "sync":
        replicas, shard = world, 1
    else:
        # a decoupled config that leaves it 0 gets one rollout rank, as the bench gives it
        rollout = rollout_ranks or p.num_rollout_ranks or 1
        shard = p.trainer_shard_degree if p.trainer_shard_degree > 0 else (world - rollout) // p.trainer_replicate_degree
        replicas = (world - rollout) // max(shard, 1)
        if replicas < 1 or replicas * shard + rollout != world:
            raise ValueError(
                f"placement: {world} ranks cannot hold {rollout} rollout ranks and trainer replicas of shard degree "
                f"{shard} (placement.trainer_shard_degree); pass --world or fix the placement section"
            )
    return SimConfig(
        mode=mode, gpus=world, prompts_per_step=cfg.training.prompts_per_step, group_size=cfg.training.group_size,
        steps=steps, replicas=replicas, shard_degree=shard, sigma=replay.sigma, tau=replay.tau, delta=replay.delta,
        interval=1 if mode == "sync" else cfg.weight_sync.interval, b_max=cfg.rollout.b_max,
        adaptive_concurrency=scheduler.adaptive_concurrency and mode in ("async", "reflow"),
        kv_admission=scheduler.kv_admission and mode in ("async", "reflow"),
        adaptive_placement=scheduler.adaptive_placement and mode == "reflow",
        rho=scheduler.rho, response_percentile=scheduler.response_percentile, cooldown_steps=scheduler.cooldown_steps,
        margin=scheduler.margin, horizon_steps=scheduler.horizon_steps, warmup_steps=warmup_steps,
        strict_window=replay.strict_window, dynamic_sampling=cfg.reward.dynamic_sampling and mode != "one_step_off",
        seed=cfg.job.seed, macro_steps=1, micro_batch_size=cfg.training.micro_batch_size,
        micro_batch_tokens=cfg.training.micro_batch_tokens,
    )


def workload_of(cfg: JobConfig, root: str, named: str = "") -> Workload:
    """The task's train file's lengths (chain_sum-style rows: "prompt" and "answer" strings), or ``named``."""
    if named:
        if named not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(sorted(WORKLOADS))}, got {named!r}")
        return WORKLOADS[named]
    path = cfg.task.train_file if os.path.isabs(cfg.task.train_file) else os.path.join(root, cfg.task.train_file)
    with open(path, encoding="utf-8") as f:
        first = json.loads(f.readline())
    if not (isinstance(first.get("prompt"), str) and isinstance(first.get("answer"), str)):
        raise ValueError(
            f"task.train_file = {cfg.task.train_file}: its rows are not chain_sum-style text (prompt and answer "
            "strings), whose lengths the simulator reads; pass --workload with a named workload"
        )
    return chain_sum_workload(path, cfg.rollout.max_new_tokens)


def predict(cfg: JobConfig, world: int, profile: CostProfile, workload: Workload, steps: int, warmup_steps: int,
            mode: str | None = None, seeds: int = 1) -> dict:
    """The simulator's prediction of ``cfg`` (in ``mode``): ``PREDICTED``, the mean over ``seeds`` simulations
    (``simulate_seeds``), each value's standard deviation over them, and the summary itself."""
    run = simulate_seeds(
        sim_config(cfg, world, steps, warmup_steps, mode), with_engine_settings(profile, cfg.rollout), workload, seeds,
    )
    run.pop("timeline", None)
    return {
        "predicted": {key: run[key] for key in PREDICTED},
        "seed_sd": {key: run["seed_sd"][key] for key in PREDICTED},
        "simulation": run,
    }
