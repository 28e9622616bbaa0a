"""ReFlow: replay-driven decoupling for efficient RL post-training of LLMs.

Where things live:
  config/        the one config tree (TOML + --section.key=value overrides)
  model/         model zoo recipes -> torchtitan Qwen3 configs
  trainer/       FSDP2 policy trainer (loss, optimizer, HF checkpoints)
  rollout/       the embedded vLLM engine of each rank
  weight_sync/   trainer -> rollout weight transfer (bucketed broadcast)
  algorithms/    the algorithm menu: advantage estimators, policy losses, aggregations, corrections
  tasks/         reward environments (chain_sum, ...)
  modes/         training loops: sync, one_step_off, async, reflow
  metrics/       console, metrics.jsonl, TensorBoard
  distributed/   placement, meshes, process groups
"""

__version__ = "0.1.0"
