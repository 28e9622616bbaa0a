"""A GPU recipe's code paths at CPU scale: the overrides that run a shipped GPU config on a few CPU ranks.

    python -m reflow.config.cpu_scale train_configs/dapo_qwen3_8b_math.toml 4     # prints the overrides
    torchrun --nproc-per-node 4 -m reflow.train --config train_configs/dapo_qwen3_8b_math.toml $(python -m ...)

What changes is only what a CPU cannot hold or run: the model (the tiny Qwen3 warm-started for the recipe's
kind of task, in place of 4B-32B), flex attention (no backward on a CPU: SDPA), torch.compile (minutes of C++
compile; ``tests/trainer/test_block_options.py`` covers it), lengths, batch sizes and the eval set, the engine's
tensor parallelism, the dataset (the tiny task of the same kind: math -> chain_sum_boxed, retool ->
chain_sum_calculator, coding_agent stays) and the world (the placement keeps its shape: the same number of trainer
replicas, one rank a shard, the rest rollout; colocated stays colocated). What stays is what breaks at a GPU
run's first checkpoint or sync: the mode, the placement's replicas, the algorithm (advantage, loss, KL,
dynamic sampling, overlong shaping scaled to the new length), replay, the weight-sync interval, the scheduler,
activation checkpointing, the gather dtype, and checkpointing (every step) with the HF export.
"""

from __future__ import annotations

import sys

from reflow.config.job_config import JobConfig

TINY_TASKS = {  # a GPU recipe's task -> (the tiny task of the same kind, its train and eval files)
    "chain_sum": ("chain_sum", "assets/data/chain_sum_train.jsonl", "assets/data/chain_sum_eval.jsonl"),
    "math": ("chain_sum_boxed", "assets/data/chain_sum_train.jsonl", "assets/data/chain_sum_eval.jsonl"),
    "chain_sum_boxed": ("chain_sum_boxed", "assets/data/chain_sum_train.jsonl", "assets/data/chain_sum_eval.jsonl"),
    "retool": ("chain_sum_calculator", "assets/data/chain_sum_calc_train.jsonl", "assets/data/chain_sum_calc_eval.jsonl"),
    "coding_agent": ("coding_agent", "assets/data/chain_sum_code_train.jsonl", "assets/data/chain_sum_code_eval.jsonl"),
}
MAX_NEW_TOKENS = 48
MAX_MODEL_LEN = 256


def cpu_scale_overrides(cfg: JobConfig, world: int) -> list[str]:
    """``--section.key=value`` overrides that run ``cfg`` on ``world`` CPU ranks (see the module's docstring)."""
    if cfg.task.name not in TINY_TASKS:
        raise ValueError(f"task.name: no CPU-scale task for {cfg.task.name!r} (known: {', '.join(TINY_TASKS)})")
    task, train_file, eval_file = TINY_TASKS[cfg.task.name]
    training, placement = cfg.training, cfg.placement
    colocated = placement.num_rollout_ranks == 0
    replicas = 1 if colocated else min(placement.trainer_replicate_degree, world - 1)
    prompts = 4
    group = min(training.group_size, 4)
    # each trainer rank gets its share of the batch; every minibatch keeps at least one row per rank
    minibatches = min(training.num_minibatches, prompts * group // (world if colocated else replicas))
    overlong = cfg.reward.overlong_buffer * MAX_NEW_TOKENS // max(cfg.rollout.max_new_tokens, 1)
    overrides = {
        "model.recipe": "tiny_tools" if task != "chain_sum" else "tiny",
        "model.attention": "sdpa",
        "training.compile": "false",
        "training.steps": "2",
        "training.prompts_per_step": str(prompts),
        "training.group_size": str(group),
        "training.num_minibatches": str(max(minibatches, 1)),
        "training.micro_batch_size": str(min(training.micro_batch_size, 4)),
        "rollout.max_new_tokens": str(MAX_NEW_TOKENS),
        "rollout.max_model_len": str(MAX_MODEL_LEN),
        "rollout.max_num_seqs": "64",
        "rollout.tensor_parallel_degree": "1",
        "rollout.enforce_eager": "true",
        "placement.trainer_replicate_degree": str(replicas),
        "placement.trainer_shard_degree": "-1" if colocated else "1",
        "placement.num_rollout_ranks": "0" if colocated else str(world - replicas),
        "placement.gpu_memory_gib": "0",
        "weight_sync.bucket_size_mb": "1",
        "task.name": task,
        "task.train_file": train_file,
        "task.eval_file": eval_file,
        "task.chat": "false",
        "metrics.eval_interval": "0",
        "checkpoint.enable": "true",
        "checkpoint.interval": "1",
        "reward.overlong_buffer": str(overlong),
    }
    return [f"--{key}={value}" for key, value in overrides.items()]


def main(argv: list[str]) -> int:
    from reflow.config import ConfigManager

    if len(argv) != 2:
        print("usage: python -m reflow.config.cpu_scale CONFIG WORLD", file=sys.stderr)
        return 2
    cfg = ConfigManager().parse_args(["--config", argv[0]])
    print(" ".join(cpu_scale_overrides(cfg, int(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
