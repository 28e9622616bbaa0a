"""Config checks: every field's declared limit and every section's own rules (``reflow.config.job_config``),
then what needs more than one section: combinations, the world size, the model recipe."""

from __future__ import annotations

import dataclasses

from reflow.config.job_config import JobConfig, field_problems
from reflow.config.manager import ConfigError


def validate(cfg: JobConfig, where=lambda key: "default") -> None:
    """Raise ConfigError naming the key and where its value came from (file, command line or default)."""

    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{where(key)}: '{key}' {msg}")

    # 1. every field within the limit declared at it, and each section's own rules
    for section_spec in dataclasses.fields(cfg):
        section = getattr(cfg, section_spec.name)
        problems = field_problems(section) + (section.rules() if hasattr(section, "rules") else [])
        for name, problem in problems:
            fail(f"{section_spec.name}.{name}", problem)
    # 2. what needs more than one section
    t, r = cfg.training, cfg.rollout
    if r.tensor_parallel_degree > 1 and t.mode == "sync":
        fail(
            "rollout.tensor_parallel_degree",
            f"= {r.tensor_parallel_degree} needs a decoupled mode (one_step_off, async, reflow): 'sync' generates "
            "on every rank independently",
        )
    if t.mode == "sync" and cfg.weight_sync.interval != 1:
        fail("weight_sync.interval", f"must be 1 in 'sync' mode (on-policy), got {cfg.weight_sync.interval}")
    if r.top_p < 1 and cfg.off_policy.correction != "none":
        fail(
            "rollout.top_p",
            f"= {r.top_p} renormalizes vLLM's sampling distribution, which biases the importance weights; "
            "use 1.0 or set off_policy.correction = 'none'",
        )
    if 0 < t.micro_batch_tokens < r.max_model_len:
        fail(
            "training.micro_batch_tokens",
            f"= {t.micro_batch_tokens} is below rollout.max_model_len ({r.max_model_len}): a row that long would not "
            "fit any micro-batch (set it to at least the longest row, or 0 for micro_batch_size rows each)",
        )
    # vLLM keeps one block as its null block and refuses, on every rank at start-up, a cache that cannot hold one
    # request of max_model_len tokens
    kv_tokens = (r.num_kv_blocks - 1) * r.kv_block_size
    if r.num_kv_blocks and r.kv_block_size and kv_tokens < r.max_model_len:
        fail(
            "rollout.num_kv_blocks",
            f"= {r.num_kv_blocks} blocks of rollout.kv_block_size = {r.kv_block_size} tokens hold "
            f"{kv_tokens} tokens (vLLM keeps one block back), below rollout.max_model_len "
            f"({r.max_model_len}): vLLM could not serve one request of that length (use at least "
            f"{-(-r.max_model_len // r.kv_block_size) + 1} blocks, or a shorter max_model_len)",
        )
    if cfg.kl.placement == "reward" and cfg.kl.coef == 0:
        fail("kl.placement", "= 'reward' needs kl.coef > 0")
    if cfg.reward.dynamic_sampling and t.mode == "one_step_off":
        fail(
            "reward.dynamic_sampling",
            "needs 'sync', 'async' or 'reflow': 'one_step_off' trains exactly the batch the previous policy began, "
            "and a dropped group's replacement starts under the next policy, so the step would wait for it forever "
            "(docs/decoupled_protocol.md)",
        )
    if cfg.reward.dynamic_sampling and cfg.advantage.estimator == "reinforce_pp" and not cfg.advantage.group_baseline:
        fail(
            "reward.dynamic_sampling",
            "drops groups whose rewards are all equal, but with advantage.estimator = 'reinforce_pp' and "
            "advantage.group_baseline = false such a group has a nonzero advantage (it is whitened against the "
            "batch, not its group): set advantage.group_baseline = true or turn dynamic sampling off",
        )
    if t.mode != "sync" and cfg.metrics.eval_interval > 0:
        from reflow.config.mode_settings import resolve_settings

        interval = resolve_settings(cfg).interval
        if cfg.metrics.eval_interval % interval:
            fail(
                "metrics.eval_interval",
                f"= {cfg.metrics.eval_interval} must be a multiple of the weight-sync interval ({interval}): in "
                f"'{t.mode}' mode the rollout ranks evaluate a policy version right after its weight sync",
            )
    if cfg.checkpoint.load_step >= 0 and not cfg.checkpoint.enable:
        fail("checkpoint.load_step", f"= {cfg.checkpoint.load_step} needs checkpoint.enable = true")
    _validate_scheduler(cfg, fail)
    _validate_agent(cfg, fail)


def _validate_agent(cfg: JobConfig, fail) -> None:
    task = cfg.task
    if task.agent and task.name != "agent":
        fail("task.agent", f"is read by task.name = 'agent' only (task.name = {task.name!r})")
    if task.name != "agent":
        return
    if not task.agent:
        fail("task.agent", "must name the agent as 'module:function' (docs/agents.md)")
    if cfg.scheduler.adaptive_placement or cfg.placement.schedule:
        fail("task.name", "= 'agent' runs its episodes on the rank that started them: it needs a fixed placement "
             "(scheduler.adaptive_placement = false, no placement.schedule)")


def _validate_scheduler(cfg: JobConfig, fail) -> None:
    sched, mode = cfg.scheduler, cfg.training.mode
    for key, on in (("scheduler.adaptive_concurrency", sched.adaptive_concurrency),
                    ("scheduler.kv_admission", sched.kv_admission)):
        if on and mode not in ("async", "reflow"):
            fail(
                key,
                f"applies to the rollout workers of 'async' and 'reflow' (training.mode = {mode!r}: "
                + ("one_step_off admits each step's whole window at once by design)" if mode == "one_step_off"
                   else "sync generates each batch whole)"),
            )
    if sched.adaptive_placement:
        if mode != "reflow":
            fail("scheduler.adaptive_placement", f"moves ranks in 'reflow' mode only (training.mode = {mode!r})")
        if cfg.placement.schedule:
            fail("scheduler.adaptive_placement", "and placement.schedule both decide the placement: set one of them")


def validate_world(cfg: JobConfig, world_size: int, where=lambda key: "default"):
    """Build the placement for this world size; errors name the placement keys."""
    from reflow.distributed.placement import build_placement

    p = cfg.placement
    try:
        placement = build_placement(
            world_size, p.trainer_replicate_degree, p.trainer_shard_degree, p.num_rollout_ranks, where=where,
            rollout_tp=cfg.rollout.tensor_parallel_degree,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.training.mode == "sync" and not placement.colocated:
        raise ConfigError(
            f"{where('placement.num_rollout_ranks')}: 'placement.num_rollout_ranks' must be 0 in 'sync' mode "
            f"(colocated: every rank trains and generates), got {placement.num_rollout_ranks}"
        )
    if cfg.training.mode != "sync":
        if placement.colocated:
            raise ConfigError(
                f"{where('placement.num_rollout_ranks')}: training.mode = {cfg.training.mode!r} decouples training "
                "from generation: set placement.num_rollout_ranks >= 1"
            )
        _validate_decoupled(cfg, placement, where)
    if cfg.training.mode == "sync" and cfg.training.prompts_per_step % world_size:
        raise ConfigError(
            f"{where('training.prompts_per_step')}: 'training.prompts_per_step' = {cfg.training.prompts_per_step} "
            f"must be divisible by the number of ranks ({world_size}) in 'sync' mode"
        )
    return placement


def parse_schedule(cfg: JobConfig, placement, where=lambda key: "default") -> list[tuple[int, int]]:
    """placement.schedule as (after step, trainer replicas) pairs, each one checked: a sync step inside the
    run, in order, a feasible placement (both pools non-empty), and a dispatch rule that feeds every shard and
    every rollout rank there."""
    from dataclasses import replace

    from reflow.distributed.placement import build_placement

    key = "placement.schedule"

    def fail(msg: str) -> None:
        raise ConfigError(f"{where(key)}: '{key}' {msg}")

    if cfg.training.mode != "reflow":
        fail(f"is supported in 'reflow' mode only (got training.mode = {cfg.training.mode!r})")
    out: list[tuple[int, int]] = []
    previous_step, replicas_now = 0, placement.replicate_degree
    most = (placement.world_size - 1) // placement.shard_degree
    for entry in cfg.placement.schedule:
        text = str(entry)
        step_text, _, replicas_text = text.partition(":")
        if not (step_text.strip().isdigit() and replicas_text.strip().isdigit()):
            fail(f'entry {entry!r} must be "STEP:REPLICAS", e.g. "10:1"')
        step, replicas = int(step_text), int(replicas_text)
        if not previous_step < step < cfg.training.steps:
            fail(f"entry {text!r}: steps must increase and stay below training.steps = {cfg.training.steps}")
        if step % cfg.weight_sync.interval:
            fail(f"entry {text!r}: step {step} is not a weight-sync step (a multiple of weight_sync.interval = "
                 f"{cfg.weight_sync.interval})")
        if not 1 <= replicas <= most:
            fail(
                f"entry {text!r}: {replicas} trainer replicas of {placement.shard_degree} ranks leave no rollout rank "
                f"or no trainer in a world of {placement.world_size} (feasible: 1 .. {most})"
            )
        if replicas == replicas_now:
            fail(f"entry {text!r}: the trainer already has {replicas} replicas then")
        try:
            there = build_placement(placement.world_size, replicas, placement.shard_degree,
                                    placement.world_size - replicas * placement.shard_degree, rollout_tp=placement.rollout_tp)
        except ValueError as e:
            fail(f"entry {text!r}: {e}")
        sub = replace(cfg, placement=replace(cfg.placement, schedule=[], trainer_replicate_degree=replicas,
                                             num_rollout_ranks=there.num_rollout_ranks))
        try:
            _validate_decoupled(sub, there, where)
        except ConfigError as e:
            fail(f"entry {text!r} ({there.name}): {e}")
        out.append((step, replicas))
        previous_step, replicas_now = step, replicas
    return out


def _validate_decoupled(cfg: JobConfig, placement, where) -> None:
    """The decoupled modes' dispatch rule must be able to feed every trainer shard and every rollout rank."""
    from reflow.config.mode_settings import resolve_settings
    from reflow.scheduler import share_groups

    mode, training = cfg.training.mode, cfg.training
    group_size, num_rollout, num_shards = training.group_size, len(placement.rollout_workers), placement.num_trainer_ranks
    batch = training.prompts_per_step * group_size
    if mode in ("async", "reflow") and cfg.replay.delta < cfg.weight_sync.interval:
        raise ConfigError(
            f"{where('replay.delta')}: 'replay.delta' = {cfg.replay.delta} must be >= weight_sync.interval = "
            f"{cfg.weight_sync.interval} in '{mode}' mode: otherwise every sample of a version goes stale before the "
            "next sync and the trainer starves"
        )
    if training.prompts_per_step % num_shards:
        raise ConfigError(
            f"{where('training.prompts_per_step')}: 'training.prompts_per_step' = {training.prompts_per_step} must be "
            f"a multiple of the {num_shards} trainer ranks in '{mode}' mode (each shard trains whole groups)"
        )
    if cfg.rollout.max_num_seqs < group_size:
        raise ConfigError(
            f"{where('rollout.max_num_seqs')}: 'rollout.max_num_seqs' = {cfg.rollout.max_num_seqs} must be >= "
            f"training.group_size = {group_size} in '{mode}' mode: rollout ranks admit whole groups"
        )
    b_max = cfg.rollout.b_max
    if b_max and mode != "reflow":
        raise ConfigError(
            f"{where('rollout.b_max')}: 'rollout.b_max' applies to 'reflow' mode only; '{mode}' bounds the samples "
            "started but not yet trained instead (see docs/decoupled_protocol.md)"
        )
    if b_max and (b_max < batch or b_max % group_size):
        raise ConfigError(
            f"{where('rollout.b_max')}: 'rollout.b_max' = {b_max} samples per trainer step must be a multiple of "
            f"training.group_size ({group_size}) and >= the batch ({batch}), or the trainer would starve"
        )
    rule = resolve_settings(cfg).dispatch
    for limit, name in ((rule.window, "the window of samples started but not yet trained"), (rule.per_step, "B_max")):
        if limit and limit // group_size < num_rollout:
            raise ConfigError(
                f"{where('placement.num_rollout_ranks')}: 'placement.num_rollout_ranks' = {placement.num_rollout_ranks} "
                f"makes {num_rollout} rollout engines, more than "
                f"{name} ({limit // group_size} groups): some engines would never generate; use fewer rollout "
                "ranks or raise training.prompts_per_step" + (" or rollout.b_max" if mode == "reflow" else "")
            )
    if mode == "one_step_off":
        per_rank = max(share_groups(rule.window // group_size, num_rollout)) * group_size
        if cfg.rollout.max_num_seqs < per_rank:
            raise ConfigError(
                f"{where('rollout.max_num_seqs')}: 'rollout.max_num_seqs' = {cfg.rollout.max_num_seqs} must be >= "
                f"{per_rank} in 'one_step_off' mode: each engine admits its whole share of the two batches in flight "
                "at once, so that every batch is generated by exactly one policy version"
            )


MODE_KEYS = {
    "replay.sigma": ("reflow",),
    "replay.tau": ("reflow",),
    "replay.sampler": ("reflow",),
    "replay.filter": ("reflow",),
    "replay.delta": ("async", "reflow"),
    "replay.staleness_from": ("async", "reflow"),
    "replay.max_head_lag": ("async", "reflow"),
    "weight_sync.interval": ("sync", "async", "reflow"),
}
"""Keys that only some modes read; one_step_off fixes delta = 1 and a sync every step by definition."""


RATIO_POLICIES = ("gspo", "dual_clip", "cispo")
"""Policy losses that differ from plain ppo_clip only where the ratio of the new policy to the old is not 1."""


def mode_warnings(cfg: JobConfig, where=lambda key: "default") -> list[str]:
    """Settings that have no effect in this run (said, not rewritten): keys set in a file or on the command line
    that the chosen mode does not read, and a ratio-based policy loss with one update per batch."""
    mode = cfg.training.mode
    warnings = [
        f"{where(key)}: '{key}' is not used in '{mode}' mode (it applies to {', '.join(modes)})"
        for key, modes in MODE_KEYS.items()
        if mode not in modes and where(key) != "default"
    ]
    training = cfg.training
    if cfg.loss.policy in RATIO_POLICIES and training.ppo_epochs == 1 and training.num_minibatches == 1:
        # one update per batch: the old log-probs are the new ones, detached, so every ratio is exactly 1
        warnings.append(
            f"{where('loss.policy')}: loss.policy = '{cfg.loss.policy}' with one update per batch "
            "(training.ppo_epochs = training.num_minibatches = 1): the ratio to the old policy is exactly 1, so its "
            "clip never binds and the gradient is plain ppo_clip's (GSPO: under seq_mean_token_mean, bitwise); set "
            "training.num_minibatches > 1 for the loss to matter"
        )
    return warnings


def validate_recipe(cfg: JobConfig, recipe, placement, where=lambda key: "default") -> list[str]:
    """Check the run against the model recipe; returns warnings (e.g. a GPU recipe on a CPU machine)."""
    warnings = []
    lora = cfg.lora
    if lora.enabled and recipe.architecture.tie_embeddings and lora.train_embeddings != lora.train_head:
        raise ConfigError(f"{where('lora.train_head')}: 'lora.train_head' = {lora.train_head} with "
                          f"'lora.train_embeddings' = {lora.train_embeddings}: recipe {recipe.name} ties its head to its "
                          "embeddings (one tensor); set both or neither")
    par = recipe.parallelism
    if placement.world_size < par.min_world_size:
        warnings.append(
            f"recipe {recipe.name} recommends at least {par.min_world_size} ranks; this run has {placement.world_size}"
        )
    if par.trainer_shard_degree > 0 and placement.shard_degree != par.trainer_shard_degree:
        warnings.append(
            f"recipe {recipe.name} recommends placement.trainer_shard_degree = {par.trainer_shard_degree}; "
            f"this run uses {placement.shard_degree}"
        )
    if cfg.rollout.max_model_len > recipe.vllm.max_model_len:
        warnings.append(
            f"rollout.max_model_len = {cfg.rollout.max_model_len} is above recipe {recipe.name}'s recommended "
            f"{recipe.vllm.max_model_len}"
        )
    if cfg.rollout.max_num_seqs > recipe.vllm.max_num_seqs:
        warnings.append(
            f"rollout.max_num_seqs = {cfg.rollout.max_num_seqs} is above recipe {recipe.name}'s recommended "
            f"{recipe.vllm.max_num_seqs}"
        )
    if cfg.training.param_dtype == "bfloat16" and recipe.device != "cuda":
        warnings.append(
            f"training.param_dtype = 'bfloat16' with recipe {recipe.name}, whose engine runs float32 on CPU: the trainer's "
            "log-probs then differ from vLLM's by bf16 rounding (behavior_logprob_gap grows), and the importance weights "
            "with them"
        )
    if recipe.device == "cuda" and cfg.rollout.gpu_memory_utilization > recipe.vllm.gpu_memory_utilization:
        warnings.append(
            f"rollout.gpu_memory_utilization = {cfg.rollout.gpu_memory_utilization} is above recipe "
            f"{recipe.name}'s recommended {recipe.vllm.gpu_memory_utilization} (the trainer shares the GPU)"
        )
    if cfg.rollout.max_model_len > recipe.architecture.max_seq_len:
        raise ConfigError(
            f"{where('rollout.max_model_len')}: 'rollout.max_model_len' = {cfg.rollout.max_model_len} exceeds the "
            f"model's max_seq_len {recipe.architecture.max_seq_len} ({recipe.path})"
        )
    tp = cfg.rollout.tensor_parallel_degree
    if recipe.architecture.n_heads % tp:
        raise ConfigError(
            f"{where('rollout.tensor_parallel_degree')}: 'rollout.tensor_parallel_degree' = {tp} does not divide the "
            f"model's {recipe.architecture.n_heads} attention heads ({recipe.path})"
        )
    if tp != par.rollout_tensor_parallel_degree:
        warnings.append(
            f"recipe {recipe.name} recommends rollout.tensor_parallel_degree = {par.rollout_tensor_parallel_degree}; "
            f"this run uses {tp}"
        )
    if recipe.device == "cuda":
        warnings.append(f"recipe {recipe.name} is meant for GPUs (vLLM {recipe.vllm.dtype}, "
                        f"TP {par.rollout_tensor_parallel_degree})")
    return warnings
