"""The one config tree of ReFlow.

Every section is a small dataclass; every field has a typed default and a
docstring (the string literal right below it, which ``--help`` prints).
``reflow.config.manager`` loads TOML into this tree, applies
``--section.key=value`` overrides and validates the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("sync", "one_step_off", "async", "reflow")


@dataclass
class Job:
    description: str = "ReFlow run"
    """Free text shown in logs."""
    dump_folder: str = "./outputs/tiny"
    """Where metrics.jsonl, TensorBoard events (tb/), checkpoints and exports go."""
    seed: int = 0
    """Seed for prompt order, vLLM sampling and parameter init."""
    cpu_affinity: bool = False
    """CPU runs: pin each rank to its own core with one compute thread, so a waiting rank is really idle."""
    collective_timeout_s: int = 600
    """Longest a collective waits for a rank before it fails, so a lost rank ends the run instead of hanging
    it (torchrun --max-restarts then restarts every rank from the latest checkpoint). Keep it above the
    longest step, checkpoint or HF export."""


@dataclass
class Model:
    recipe: str = "tiny"
    """Model zoo recipe: the name of a TOML file in models/ (e.g. 'tiny', 'qwen3_8b')."""
    hf_checkpoint: str = ""
    """Hugging Face-format folder (config.json, tokenizer, safetensors). Empty: the recipe's."""
    attention: str = "sdpa"
    """Trainer attention: 'sdpa' (causal, has a CPU backward) or 'flex' (GPU only)."""


@dataclass
class Training:
    mode: str = "sync"
    """Training mode: 'sync' (on-policy, colocated), 'one_step_off', 'async' (staleness replay.delta,
    no replay) or 'reflow' (bounded replay). The last three decouple trainer and rollout ranks."""
    steps: int = 100
    """Number of trainer steps (optimizer updates on a fresh batch)."""
    time_budget_s: float = 0.0
    """Stop after this many seconds of training (0 = no limit; training.steps still caps the run)."""
    prompts_per_step: int = 32
    """Prompts per trainer step, across all ranks (each yields a group of group_size samples)."""
    group_size: int = 8
    """GRPO group size G: completions sampled per prompt."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    max_norm: float = 1.0
    """Gradient clipping max norm (<= 0 disables clipping)."""
    clip_eps: float = 0.2
    """PPO clip range epsilon (ratio clipped to [1-eps, 1+eps])."""
    clip_eps_high: float = 0.0
    """Upper clip epsilon if > 0 (asymmetric 'clip-higher'); 0 means use clip_eps."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL penalty to the frozen reference policy (0 disables the reference)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    num_minibatches: int = 1
    """Optimizer updates per pass (the batch is split into this many minibatches)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward on one rank (gradient accumulation inside a minibatch)."""
    advantage_eps: float = 1e-6
    """Added to the group reward std when normalizing advantages."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO-style centring."""
    is_truncation: float = 2.0
    """Truncated importance weight cap against vLLM behavior log-probs (<= 0 disables the correction)."""
    max_nonfinite_steps: int = 3
    """An optimizer update whose loss or gradients are NaN or inf is skipped (and logged: skipped_updates); after
    this many steps in a row with a skipped update the run stops with an error (0: never stop)."""
    activation_checkpointing: str = "none"
    """'none' or 'full': recompute each transformer block in the backward pass (torchtitan's FullAC), trading
    compute for activation memory on long sequences."""
    compile: bool = False
    """torch.compile every transformer block of the policy in place (state-dict names unchanged), before FSDP2,
    as torchtitan's apply_compile does: Inductor kernels, paid for by a compile in the first steps (and a
    recompile when the micro-batch shape first changes, after which shapes are treated as dynamic). On CPU
    it needs a C++ compiler."""
    param_dtype: str = "float32"
    """Dtype FSDP2 gathers parameters in for compute: 'float32' or 'bfloat16' (mixed precision on GPU; the
    shards, the optimizer and the gradient reduction stay float32)."""
    offload_while_generating: bool = True
    """'sync' mode on CUDA: the trainer's parameter shards, AdamW moments and frozen reference wait in pinned
    host memory while the colocated engine generates (and the engine sleeps while the trainer trains).
    No effect on CPU, where both share host memory."""


@dataclass
class Rollout:
    max_new_tokens: int = 32
    """Completion length cap."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 = off; keep 1.0 for exact behavior log-probs)."""
    max_num_seqs: int = 128
    """vLLM: sequences one engine step may hold."""
    max_model_len: int = 256
    """vLLM: max prompt + completion length."""
    kv_cache_gib: float = 1.0
    """CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    kv_block_size: int = 0
    """Tokens per KV-cache block; 0: vLLM's default (128 on CPU, 16 on GPU)."""
    num_kv_blocks: int = 0
    """KV-cache blocks per engine (vLLM's num_gpu_blocks_override); 0: vLLM sizes the cache from memory. A small
    value makes a tiny model feel the KV pressure a large one feels (tests, benchmarks)."""
    gpu_memory_utilization: float = 0.5
    """GPU: fraction of the device vLLM may take (the trainer shares it)."""
    enforce_eager: bool = True
    """vLLM: skip CUDA graphs / compilation (always True on CPU)."""
    tensor_parallel_degree: int = 1
    """vLLM tensor parallel degree per engine (s_R). Only 1 is supported in this build."""
    b_max: int = 0
    """B_max ('reflow' mode): most samples that may start generating between two trainer steps, over all
    rollout ranks (a multiple of group_size, >= the batch); credit a step leaves unused expires. 0 = the batch,
    prompts_per_step * group_size, as in the paper. On top of it, as in 'async', the samples started but not
    yet trained stay within a window: (delta - weight_sync.interval + 1) batches plus ceil(b (1 - sigma))
    samples, the fewest fresh samples a step retires (docs/decoupled_protocol.md)."""


@dataclass
class Placement:
    trainer_replicate_degree: int = 1
    """HSDP replica dimension of the trainer pool (n_T)."""
    trainer_shard_degree: int = -1
    """HSDP shard dimension (s_T); -1 = all remaining trainer ranks."""
    num_rollout_ranks: int = 0
    """Ranks that only generate. 0 = colocated: every rank both trains and generates (sync mode)."""
    schedule: list[str] = field(default_factory=list)
    """Forced placement changes ('reflow' mode): "STEP:REPLICAS" entries, e.g. ["10:1", "20:2"]: after trainer
    step STEP (a weight-sync step) the trainer has REPLICAS replicas of trainer_shard_degree ranks and the
    other ranks generate. Ranks change role in place: no restart."""


@dataclass
class WeightSync:
    interval: int = 1
    """Trainer steps between weight syncs to the rollout engines (k)."""
    bucket_size_mb: float = 64.0
    """Flat broadcast bucket size in MiB."""


@dataclass
class Replay:
    sigma: float = 0.25
    """Max replayed share of a batch: a batch of b holds >= b(1-sigma) unused samples ('reflow' mode)."""
    tau: float = 0.5
    """Loss weight of a replayed sample relative to a fresh one (w = tau * omega)."""
    delta: int = 2
    """Staleness bound: a sample is trained only within delta policy versions of its anchor (staleness_from).
    In 'async' mode this is the staleness k; 'one_step_off' uses 1."""
    staleness_from: str = "finish"
    """'async' and 'reflow': the version a sample's staleness counts from. 'finish': the version at which its
    group finished, as verl's fully-async stamps it (a long answer is as fresh as a short one that arrives with
    it); 'start': the version that produced its oldest token. 'one_step_off' always counts from the start."""
    max_head_lag: int = 0
    """'async' and 'reflow': model tokens more than this many versions behind the policy being trained are
    masked out of the loss (the rest of the trajectory still trains). 0 (default): 2 x delta, so a token is at
    most twice as stale as the freshness bound of a whole sample allows; otherwise >= delta."""
    sampler: str = "random"
    """Which replayed samples fill a batch: 'random' or 'medium_reward'."""
    filter: str = "accept_all"
    """Which consumed samples may be replayed: 'accept_all', 'reward_band' or 'nonzero_advantage'."""
    filter_reward_low: float = 0.0
    """reward_band filter: lowest reward kept."""
    filter_reward_high: float = 1.0
    """reward_band filter: highest reward kept."""


@dataclass
class Task:
    name: str = "chain_sum"
    """Task (reward environment): a key of reflow.tasks.TASKS."""
    train_file: str = "assets/data/chain_sum_train.jsonl"
    """JSONL prompts with answers."""
    eval_file: str = "assets/data/chain_sum_eval.jsonl"
    """JSONL held-out prompts (the mean reward of one sample per prompt at the rollout temperature is logged
    every metrics.eval_interval steps)."""
    reward_timeout_s: float = 5.0
    """Longest one reward may take ('math': math-verify runs out of process and is killed past it, reward 0)."""
    chat: bool = False
    """Render text prompts as a user message with the tokenizer's chat template (rows that are chat messages,
    verl's layout, always are). For instruction-tuned models such as Qwen3."""
    instructions: str = ""
    """retool, coding_agent: the instructions put before each problem (a system message for chat rows); "": the
    task's own (how to call the interpreter, how to submit a program)."""
    max_turns: int = 4
    """Multi-turn tasks: environment answers per trajectory (tool calls; the coding agent's tested programs)."""
    sandbox_wall_s: float = 10.0
    """Sandboxed code (retool, coding_agent): wall-clock seconds per run."""
    sandbox_cpu_s: float = 5.0
    """Sandboxed code: CPU seconds per run."""
    sandbox_memory_mb: int = 1024
    """Sandboxed code: address space per run (MiB)."""
    tool_workers: int = 8
    """Multi-turn tasks: threads per rollout rank that run environment calls (tools, sandboxed code) while the
    engine generates for the other trajectories."""
    shuffle: bool = True
    """Draw training prompts in a fresh seeded order each epoch; false: in the file's order (a curriculum, or a
    workload that drifts, such as assets/data/chain_sum_drift_train.jsonl)."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Write metrics every N steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under <dump_folder>/tb/."""
    enable_progress_bar: bool = True
    """Rank 0 shows progress on the console: a redrawn bar on a terminal, plain lines elsewhere (a Slurm log)."""
    progress_every: int = 10
    """Off a terminal: one plain progress line every this many logged steps (and at the last)."""
    eval_interval: int = 0
    """Evaluate every N steps (0 = off): mean reward of one sample per held-out prompt at the rollout temperature.
    The decoupled modes also evaluate a new run's starting policy (eval_policy_version 0), and the final one."""
    eval_num_prompts: int = 64
    """Prompts used by an evaluation."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints (model, optimizer, trainer state)."""
    interval: int = 50
    """Steps between checkpoints."""
    folder: str = "checkpoint"
    """Sub-folder of dump_folder (an absolute path is used as is: a run can resume from another run's checkpoints)."""
    load_step: int = -1
    """Resume from this step (-1: latest found, if any)."""
    keep_last: int = 3
    """Complete checkpoints kept: after each save the oldest beyond this many are deleted (0: keep every one)."""
    export_hf: bool = True
    """At the end, export the trained policy to <dump_folder>/hf_final in Hugging Face format."""


@dataclass
class Scheduler:
    """The adaptive scheduler (reflow.scheduler). With every part off, generation runs at rollout.max_num_seqs and
    the placement changes only by placement.schedule."""

    adaptive_concurrency: bool = False
    """Slow controller: each rollout worker's concurrency cap follows its KV usage, KV growth and preemptions."""
    kv_admission: bool = False
    """Fast admission: a request group starts only while (predicted KV tokens + its estimate) / KV budget <= rho."""
    adaptive_placement: bool = False
    """Placement planner (reflow mode): move ranks between the trainer and rollout pools at sync points."""
    alpha: float = 0.3
    """EMA factor of the controller's averages (weight of the newest measurement)."""
    rho: float = 0.9
    """KV-budget fraction the admitted groups may be predicted to fill (above 1: over-commit, trading
    preemptions for occupancy)."""
    interval_s: float = 2.0
    """Seconds between two updates of a worker's concurrency cap."""
    response_percentile: float = 0.9
    """Percentile of recent response lengths a new response is estimated at."""
    cooldown_steps: int = 4
    """Placement planner: trainer steps between two placement changes, at least."""
    margin: float = 0.1
    """Placement planner: a candidate's predicted throughput must beat the current one's by this fraction."""
    horizon_steps: int = 20
    """Placement planner: the steps over which a change's predicted saving is counted against its cost."""
    transition_cost_s: float = 2.0
    """Placement planner: the cost of a placement change until one has been measured."""
    planner_ema: float = 0.5
    """Placement planner: weight of the newest window in its smoothed rates and response length."""
    planner_warmup_steps: int = 2
    """Placement planner: steps of the run's start left out of its measurements."""
    idle_threshold: float = 0.3
    """Placement planner: an idle ratio above this, on one side for idle_windows windows in a row, re-decides
    regardless of the margin and the transition cost."""
    idle_windows: int = 2


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    rollout: Rollout = field(default_factory=Rollout)
    placement: Placement = field(default_factory=Placement)
    weight_sync: WeightSync = field(default_factory=WeightSync)
    replay: Replay = field(default_factory=Replay)
    task: Task = field(default_factory=Task)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    scheduler: Scheduler = field(default_factory=Scheduler)
