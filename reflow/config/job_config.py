"""The one config tree of ReFlow.

Every section is a small dataclass; every field has a typed default and a
docstring (the string literal right below it, which ``--help`` prints).
``reflow.config.manager`` loads TOML into this tree, applies
``--section.key=value`` overrides and validates the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

MODES = ("sync", "one_step_off", "async", "reflow")


@dataclass(frozen=True)
class Limit:
    """The values a field allows, declared at the field (``limited``); ``reflow.config.validate`` checks every
    field's limit and every section's ``rules``, then what needs more than one section."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    note: str = ""
    """Why the limit is there, said after the error."""

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (None: it is allowed)."""
        if self.choices is not None:
            if value in self.choices:
                return None
            allowed = " or ".join(repr(c) for c in self.choices) if len(self.choices) == 2 else f"one of {', '.join(self.choices)}"
            return self._said(f"must be {allowed}, got {value!r}")
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        high_ok = (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
        if low_ok and high_ok:
            return None
        return self._said(f"must be {self.describe()}, got {value}")

    def describe(self) -> str:
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low is not None and high is not None:
            return f"in {low}, {high}"
        if low is not None:
            return (">= " if self.ge is not None else "> ") + low[1:]
        return ("<= " if self.le is not None else "< ") + high[:-1]

    def _said(self, text: str) -> str:
        return f"{text} ({self.note})" if self.note else text


def limited(default: Any, **limit: Any) -> Any:
    """A field with a default and a ``Limit`` (``ge``, ``gt``, ``le``, ``lt``, ``choices``, ``note``)."""
    return field(default=default, metadata={"limit": Limit(**limit)})


def field_problems(section: Any) -> list[tuple[str, str]]:
    """(field name, what is wrong) for every field of ``section`` outside its declared limit."""
    out = []
    for spec in fields(section):
        limit = spec.metadata.get("limit")
        problem = limit.problem(getattr(section, spec.name)) if limit is not None else None
        if problem:
            out.append((spec.name, problem))
    return out


@dataclass
class JobSection:
    description: str = "ReFlow run"
    """Free text shown in logs."""
    dump_folder: str = "./outputs/tiny"
    """Where metrics.jsonl, TensorBoard events (tb/), checkpoints and exports go."""
    seed: int = 0
    """Seed for prompt order, vLLM sampling and parameter init."""
    cpu_affinity: bool = False
    """CPU runs: pin each rank to its own core with one compute thread, so a waiting rank is really idle."""
    collective_timeout_s: int = limited(600, ge=10)
    """Longest a collective waits for a rank before it fails, so a lost rank ends the run instead of hanging
    it (torchrun --max-restarts then restarts every rank from the latest checkpoint). Keep it above the
    longest step, checkpoint or HF export."""


@dataclass
class ModelSection:
    recipe: str = "tiny"
    """Model zoo recipe: the name of a TOML file in models/ (e.g. 'tiny', 'qwen3_8b')."""
    hf_checkpoint: str = ""
    """Hugging Face-format folder (config.json, tokenizer, safetensors). Empty: the recipe's."""
    attention: str = limited("sdpa", choices=("sdpa", "flex"))
    """Trainer attention: 'sdpa' (causal, has a CPU backward) or 'flex' (GPU only)."""


@dataclass
class TrainingSection:
    mode: str = limited("sync", choices=MODES)
    """Training mode: 'sync' (on-policy, colocated), 'one_step_off', 'async' (staleness replay.delta,
    no replay) or 'reflow' (bounded replay). The last three decouple trainer and rollout ranks."""
    steps: int = limited(100, ge=1)
    """Number of trainer steps (optimizer updates on a fresh batch)."""
    time_budget_s: float = 0.0
    """Stop after this many seconds of training (0 = no limit; training.steps still caps the run)."""
    prompts_per_step: int = limited(32, ge=1)
    """Prompts per trainer step, across all ranks (each yields a group of group_size samples)."""
    group_size: int = limited(8, ge=2, note="GRPO advantages compare samples of one prompt")
    """GRPO group size G: completions sampled per prompt."""
    lr: float = limited(3e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    max_norm: float = 1.0
    """Gradient clipping max norm (<= 0 disables clipping)."""
    clip_eps: float = limited(0.2, ge=0, lt=1)
    """PPO clip range epsilon (ratio clipped to [1-eps, 1+eps])."""
    clip_eps_high: float = 0.0
    """Upper clip epsilon if > 0 (asymmetric 'clip-higher'); 0 means use clip_eps."""
    kl_coef: float = limited(0.0, ge=0)
    """Coefficient of the k3 KL penalty to the frozen reference policy (0 disables the reference)."""
    ppo_epochs: int = limited(1, ge=1)
    """Passes over each batch."""
    num_minibatches: int = limited(1, ge=1)
    """Optimizer updates per pass (the batch is split into this many minibatches)."""
    micro_batch_size: int = limited(32, ge=1)
    """Sequences per forward/backward on one rank (gradient accumulation inside a minibatch)."""
    logprob_chunk_tokens: int = limited(1024, ge=0)
    """Tokens whose log-probs are computed at once: the output projection and log-softmax run a chunk at a
    time (recomputed in the backward pass), so the peak is chunk x vocabulary, not micro-batch x sequence x
    vocabulary (with Qwen3's 152k vocabulary, 1024 tokens are 0.6 GiB in fp32). 0: the whole micro-batch."""
    advantage_eps: float = 1e-6
    """Added to the group reward std when normalizing advantages."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO-style centring."""
    is_truncation: float = 2.0
    """Truncated importance weight cap against vLLM behavior log-probs (<= 0 disables the correction)."""
    max_nonfinite_steps: int = limited(3, ge=0)
    """An optimizer update whose loss or gradients are NaN or inf is skipped (and logged: skipped_updates); after
    this many steps in a row with a skipped update the run stops with an error (0: never stop)."""
    activation_checkpointing: str = limited("none", choices=("none", "full"))
    """'none' or 'full': recompute each transformer block in the backward pass (torchtitan's FullAC), trading
    compute for activation memory on long sequences."""
    compile: bool = False
    """torch.compile every transformer block of the policy in place (state-dict names unchanged), before FSDP2,
    as torchtitan's apply_compile does: Inductor kernels, paid for by a compile in the first steps (and a
    recompile when the micro-batch shape first changes, after which shapes are treated as dynamic). On CPU
    it needs a C++ compiler."""
    param_dtype: str = limited("float32", choices=("float32", "bfloat16"))
    """Dtype FSDP2 gathers parameters in for compute: 'float32' or 'bfloat16' (mixed precision on GPU; the
    shards, the optimizer and the gradient reduction stay float32)."""
    offload_while_generating: bool = True
    """'sync' mode on CUDA: the trainer's parameter shards, AdamW moments and frozen reference wait in pinned
    host memory while the colocated engine generates (and the engine sleeps while the trainer trains).
    No effect on CPU, where both share host memory."""

    def rules(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for combinations within the section."""
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            return [("betas", f"must be two numbers in [0, 1), got {self.betas}")]
        return []


@dataclass
class RolloutSection:
    max_new_tokens: int = limited(32, ge=1)
    """Completion length cap."""
    temperature: float = limited(1.0, gt=0, note="the trainer scores log-probs at this temperature")
    """Sampling temperature (the trainer scores log-probs at the same temperature)."""
    top_p: float = limited(1.0, gt=0, le=1)
    """Nucleus sampling (1.0 = off; keep 1.0 for exact behavior log-probs)."""
    max_num_seqs: int = limited(128, ge=1)
    """vLLM: sequences one engine step may hold."""
    max_model_len: int = 256
    """vLLM: max prompt + completion length."""
    kv_cache_gib: float = 1.0
    """CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    kv_block_size: int = 0
    """Tokens per KV-cache block; 0: vLLM's default (128 on CPU, 16 on GPU)."""
    num_kv_blocks: int = limited(0, ge=0, note="0: vLLM sizes the KV cache")
    """KV-cache blocks per engine (vLLM's num_gpu_blocks_override); 0: vLLM sizes the cache from memory. A small
    value makes a tiny model feel the KV pressure a large one feels (tests, benchmarks)."""
    gpu_memory_utilization: float = 0.5
    """GPU: fraction of the device vLLM may take (the trainer shares it)."""
    enforce_eager: bool = True
    """vLLM: skip CUDA graphs / compilation (always True on CPU)."""
    tensor_parallel_degree: int = 1
    """vLLM tensor parallel degree per engine (s_R): an engine spans this many consecutive ranks
(``reflow.rollout.tensor_parallel``)."""
    b_max: int = limited(0, ge=0)
    """B_max ('reflow' mode): most samples that may start generating between two trainer steps, over all
    rollout ranks (a multiple of group_size, >= the batch); credit a step leaves unused expires. 0 = the batch,
    prompts_per_step * group_size, as in the paper. On top of it, as in 'async', the samples started but not
    yet trained stay within a window: (delta - weight_sync.interval + 1) batches plus ceil(b (1 - sigma))
    samples, the fewest fresh samples a step retires (docs/decoupled_protocol.md)."""

    def rules(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for combinations within the section."""
        if self.kv_block_size < 0 or self.kv_block_size % 16:
            return [("kv_block_size", f"must be 0 (vLLM's default) or a positive multiple of 16, got {self.kv_block_size}")]
        return []


@dataclass
class PlacementSection:
    trainer_replicate_degree: int = 1
    """HSDP replica dimension of the trainer pool (n_T)."""
    trainer_shard_degree: int = -1
    """HSDP shard dimension (s_T); -1 = all remaining trainer ranks."""
    num_rollout_ranks: int = 0
    """Ranks that only generate. 0 = colocated: every rank both trains and generates (sync mode)."""
    gpu_memory_gib: float = limited(0.0, ge=0)
    """Memory of one GPU, for the memory plan that --dry-run prints and every start checks (0: the recipe's
    [parallelism] gpu_memory_gib, 80 unless it says otherwise)."""
    allow_shared_gpu: bool = False
    """Let several ranks of a node share one GPU (more local ranks than visible GPUs): refused otherwise, as
    the ranks' engines and trainers would each plan on the whole device."""
    schedule: list[str] = field(default_factory=list)
    """Forced placement changes ('reflow' mode): "STEP:REPLICAS" entries, e.g. ["10:1", "20:2"]: after trainer
    step STEP (a weight-sync step) the trainer has REPLICAS replicas of trainer_shard_degree ranks and the
    other ranks generate. Ranks change role in place: no restart."""


@dataclass
class WeightSyncSection:
    interval: int = limited(1, ge=1)
    """Trainer steps between weight syncs to the rollout engines (k)."""
    bucket_size_mb: float = 64.0
    """Flat broadcast bucket size in MiB."""


@dataclass
class ReplaySection:
    sigma: float = limited(0.25, ge=0, lt=1)
    """Max replayed share of a batch: a batch of b holds >= b(1-sigma) unused samples ('reflow' mode)."""
    tau: float = limited(0.5, ge=0)
    """Loss weight of a replayed sample relative to a fresh one (w = tau * omega)."""
    delta: int = limited(2, ge=0)
    """Staleness bound: a sample is trained only within delta policy versions of its anchor (staleness_from).
    In 'async' mode this is the staleness k; 'one_step_off' uses 1."""
    staleness_from: str = limited("finish", choices=("finish", "start"))
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

    def rules(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for combinations within the section."""
        from reflow.replay.policies import FILTERS, SAMPLERS

        out = []
        if self.max_head_lag < 0 or (self.max_head_lag and self.max_head_lag < self.delta):
            out.append(("max_head_lag", f"= {self.max_head_lag} must be 0 (2 x delta) or >= replay.delta = {self.delta}: a "
                        "sample trained within delta would otherwise lose even its newest tokens"))
        if self.sampler not in SAMPLERS:
            out.append(("sampler", f"must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}"))
        if self.filter not in FILTERS:
            out.append(("filter", f"must be one of {', '.join(FILTERS)}, got {self.filter!r}"))
        if self.filter_reward_low > self.filter_reward_high:
            out.append(("filter_reward_low", f"({self.filter_reward_low}) must be <= replay.filter_reward_high ({self.filter_reward_high})"))
        return out


@dataclass
class TaskSection:
    name: str = "chain_sum"
    """Task (reward environment): a key of reflow.tasks.TASKS."""
    train_file: str = "assets/data/chain_sum_train.jsonl"
    """JSONL prompts with answers."""
    eval_file: str = "assets/data/chain_sum_eval.jsonl"
    """JSONL held-out prompts (the mean reward of one sample per prompt at the rollout temperature is logged
    every metrics.eval_interval steps)."""
    reward_timeout_s: float = limited(5.0, gt=0)
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
    sandbox_python: str = ""
    """Sandboxed code: the interpreter that runs it ("": this Python's base interpreter when the unprivileged
    sandbox user can read it, else /usr/bin/python3). Only its standard library is visible to the code."""
    sandbox_allow_unisolated: bool = False
    """Sandboxed code: where bubblewrap or user namespaces are missing, run model-written code anyway, with
    resource limits and an audit hook only (unsafe: hostile code gets past both; logged as a warning). False:
    such a run refuses to start, saying what to install."""
    tool_workers: int = 8
    """Multi-turn tasks: threads per rollout rank that run environment calls (tools, sandboxed code) while the
    engine generates for the other trajectories."""
    shuffle: bool = True
    """Draw training prompts in a fresh seeded order each epoch; false: in the file's order (a curriculum, or a
    workload that drifts, such as assets/data/chain_sum_drift_train.jsonl)."""


@dataclass
class MetricsSection:
    log_freq: int = limited(1, ge=1)
    """Write metrics every N steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under <dump_folder>/tb/."""
    enable_progress_bar: bool = True
    """Rank 0 shows progress on the console: a redrawn bar on a terminal, plain lines elsewhere (a Slurm log)."""
    progress_every: int = limited(10, ge=1)
    """Off a terminal: one plain progress line every this many logged steps (and at the last)."""
    eval_interval: int = 0
    """Evaluate every N steps (0 = off): mean reward of one sample per held-out prompt at the rollout temperature.
    The decoupled modes also evaluate a new run's starting policy (eval_policy_version 0), and the final one."""
    eval_num_prompts: int = 64
    """Prompts used by an evaluation."""


@dataclass
class CheckpointSection:
    enable: bool = False
    """Save distributed checkpoints (model, optimizer, trainer state)."""
    interval: int = limited(50, ge=1)
    """Steps between checkpoints."""
    folder: str = "checkpoint"
    """Sub-folder of dump_folder (an absolute path is used as is: a run can resume from another run's checkpoints)."""
    load_step: int = -1
    """Resume from this step (-1: latest found, if any)."""
    keep_last: int = limited(3, ge=0)
    """Complete checkpoints kept: after each save the oldest beyond this many are deleted (0: keep every one)."""
    export_hf: bool = True
    """At the end, export the trained policy to <dump_folder>/hf_final in Hugging Face format."""


@dataclass
class SchedulerSection:
    """The adaptive scheduler (reflow.scheduler). With every part off, generation runs at rollout.max_num_seqs and
    the placement changes only by placement.schedule."""

    adaptive_concurrency: bool = False
    """Slow controller: each rollout worker's concurrency cap follows its KV usage, KV growth and preemptions."""
    kv_admission: bool = False
    """Fast admission: a request group starts only while (predicted KV tokens + its estimate) / KV budget <= rho."""
    adaptive_placement: bool = False
    """Placement planner (reflow mode): move ranks between the trainer and rollout pools at sync points."""
    alpha: float = limited(0.3, gt=0, le=1)
    """EMA factor of the controller's averages (weight of the newest measurement)."""
    rho: float = limited(0.9, gt=0, le=2, note="above 1 over-commits against the predicted lengths")
    """KV-budget fraction the admitted groups may be predicted to fill (above 1: over-commit, trading
    preemptions for occupancy)."""
    interval_s: float = limited(2.0, gt=0)
    """Seconds between two updates of a worker's concurrency cap."""
    response_percentile: float = limited(0.9, gt=0, le=1)
    """Percentile of recent response lengths a new response is estimated at."""
    cooldown_steps: int = limited(4, ge=1)
    """Placement planner: trainer steps between two placement changes, at least."""
    margin: float = limited(0.1, ge=0)
    """Placement planner: a candidate's predicted throughput must beat the current one's by this fraction."""
    horizon_steps: int = limited(20, ge=1)
    """Placement planner: the steps over which a change's predicted saving is counted against its cost."""
    transition_cost_s: float = limited(2.0, ge=0)
    """Placement planner: the cost of a placement change until one has been measured."""
    planner_ema: float = limited(0.5, gt=0, le=1)
    """Placement planner: weight of the newest window in its smoothed rates and response length."""
    planner_warmup_steps: int = limited(2, ge=0)
    """Placement planner: steps of the run's start left out of its measurements."""
    idle_threshold: float = limited(0.3, gt=0, lt=1)
    """Placement planner: an idle ratio above this, on one side for idle_windows windows in a row, re-decides
    regardless of the margin and the transition cost."""
    idle_windows: int = limited(2, ge=1)


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    task: TaskSection = field(default_factory=TaskSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
