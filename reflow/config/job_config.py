"""The one config tree of ReFlow.

Every section is a small dataclass; every field has a typed default and a
docstring (the string literal right below it, which ``--help`` prints).
``reflow.config.manager`` loads TOML into this tree, applies
``--section.key=value`` overrides and validates the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from reflow.algorithms.names import AGGREGATIONS, CORRECTIONS, DECAYS, ESTIMATORS, KL_ESTIMATORS, KL_PLACEMENTS, POLICY_LOSSES

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
            allowed = (
                " or ".join(repr(c) for c in self.choices) if len(self.choices) == 2
                else f"one of {', '.join(self.choices)}"
            )
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
    allow_config_change: bool = False
    """Resume the run in dump_folder although its config changed in a key that changes what is trained (the
    change is recorded in run.json). Off: such a resume is refused, naming the keys (reflow.run_record)."""


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
    """Gradient clipping max norm (<= 0 disables clipping); the norm is logged before (grad_norm) and after
    (grad_norm_clipped) the clip."""
    warmup_steps: int = limited(0, ge=0)
    """Trainer steps of linear learning-rate warmup from lr / warmup updates to lr (``reflow.algorithms.schedules``)."""
    lr_decay: str = limited("constant", choices=DECAYS)
    """After the warmup: 'constant', or 'linear' or 'cosine' decay to lr * min_lr_ratio at training.steps."""
    min_lr_ratio: float = limited(0.0, ge=0, le=1)
    """The decay's floor, as a fraction of lr."""
    ppo_epochs: int = limited(1, ge=1)
    """Passes over each batch."""
    num_minibatches: int = limited(1, ge=1)
    """Optimizer updates per pass (the batch is split into this many minibatches)."""
    micro_batch_size: int = limited(32, ge=1)
    """Sequences per forward/backward on one rank (gradient accumulation inside a minibatch): at most this many."""
    micro_batch_tokens: int = limited(0, ge=0)
    """Padded tokens per forward/backward on one rank: rows are taken longest first, each micro-batch as many
    (at most micro_batch_size) as fit rows x its longest row within this budget, so a long-tail straggler pads
    a few rows rather than micro_batch_size of them (compute and activation memory follow the padded tokens).
    0: micro_batch_size rows each. At least rollout.max_model_len (the longest row runs alone)."""
    logprob_chunk_tokens: int = limited(1024, ge=0)
    """Tokens whose log-probs are computed at once: the output projection and log-softmax run a chunk at a
    time (recomputed in the backward pass), so the peak is chunk x vocabulary, not micro-batch x sequence x
    vocabulary (with Qwen3's 152k vocabulary, 1024 tokens are 0.6 GiB in fp32). 0: the whole micro-batch."""
    max_nonfinite_steps: int = limited(3, ge=0)
    """An optimizer update whose loss or gradients are NaN or inf is skipped (and logged: skipped_updates); after
    this many steps in a row with a skipped update the run stops with an error (0: never stop)."""
    activation_checkpointing: str = limited("none", choices=("none", "full"))
    """'none' or 'full': recompute each transformer block in the backward pass (torchtitan's FullAC), trading
    compute for activation memory on long sequences."""
    compile: bool = False
    """torch.compile every transformer block of the policy in place (state-dict names unchanged), before FSDP2,
    as torchtitan's apply_compile does: Inductor kernels, paid for by a compile in the first steps (and a
    recompile when the micro-batch shape first changes, after which shapes are treated as dynamic; should a
    block ever reach dynamo's recompile limit, the run fails rather than running it eagerly). On CPU it needs
    a C++ compiler."""
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
class AdvantageSection:
    """How a sample's advantage comes from the rewards (``reflow.algorithms.advantages``). A replayed sample keeps
    the advantage computed with the group (and, for REINFORCE++, the batch) it was generated in."""

    estimator: str = limited("grpo", choices=ESTIMATORS)
    """'grpo' (group mean and std), 'dr_grpo' (group mean, no std), 'rloo' (leave-one-out group mean) or
    'reinforce_pp' (normalized over the step's fresh samples on every trainer rank)."""
    eps: float = limited(1e-6, gt=0)
    """Added to the std of 'grpo' and 'reinforce_pp'."""
    group_baseline: bool = True
    """'reinforce_pp': subtract the group mean before the batch normalization (REINFORCE++-baseline); false: the
    raw rewards are normalized over the batch."""


@dataclass
class LossSection:
    """The policy loss and its aggregation (``reflow.algorithms.policy_losses``, ``.aggregation``)."""

    policy: str = limited("ppo_clip", choices=POLICY_LOSSES)
    """'ppo_clip' (asymmetric bounds), 'dual_clip' (also bounded for negative advantages), 'gspo' (sequence-level,
    length-normalized ratio) or 'cispo' (clipped, detached importance weight on the log-prob)."""
    clip_low: float = limited(0.2, ge=0, lt=1)
    """PPO and dual-clip: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = limited(0.0, ge=0)
    """Upper clip epsilon if > 0 ('clip-higher': DAPO uses 0.28); 0: clip_low."""
    dual_clip_c: float = limited(3.0, gt=1)
    """'dual_clip': the bound c of the objective for negative advantages (c * A)."""
    gspo_clip_low: float = limited(3e-4, ge=0, lt=1)
    """'gspo': the sequence ratio's clip range [1 - gspo_clip_low, 1 + gspo_clip_high] (the paper's 3e-4, 4e-4)."""
    gspo_clip_high: float = limited(4e-4, ge=0)
    cispo_clip_low: float = limited(1.0, ge=0)
    """'cispo': the importance weight is clipped to [max(1 - cispo_clip_low, 0), 1 + cispo_clip_high] (1: no lower
    bound, as in MiniMax-M1)."""
    cispo_clip_high: float = limited(4.0, ge=0)
    aggregation: str = limited("token_mean", choices=AGGREGATIONS)
    """How per-token losses become one: 'token_mean' over the batch's tokens, 'seq_mean_token_mean' (the original
    GRPO), 'seq_mean_token_sum', or 'token_sum_norm' (Dr. GRPO: token sums over a constant per sequence)."""
    norm_tokens: int = limited(0, ge=0)
    """'token_sum_norm': the constant each sequence's token sum is divided by; 0: rollout.max_new_tokens."""
    entropy_coef: float = limited(0.0, ge=0)
    """Entropy bonus: coef * entropy is subtracted from each token's loss (the entropy is logged either way)."""
    mask_truncated: bool = False
    """Overlong filtering (DAPO): samples cut at rollout.max_new_tokens leave the loss."""


@dataclass
class KLSection:
    """The KL penalty to the frozen reference policy (``reflow.algorithms.kl``)."""

    coef: float = limited(0.0, ge=0)
    """beta; 0: no reference model and no penalty."""
    estimator: str = limited("k3", choices=KL_ESTIMATORS)
    """'k1' (log-ratio), 'k2' (half its square) or 'k3' (GRPO's, exp(d) - d - 1)."""
    placement: str = limited("loss", choices=KL_PLACEMENTS)
    """'loss': beta * k per token in the loss; 'reward': -beta * k per token as a reward, its return-to-go taken
    from each token's advantage (detached)."""


@dataclass
class OffPolicySection:
    """The correction against the engine's behaviour log-probs (``reflow.algorithms.off_policy``): staleness and
    engine mismatch. The mismatch is logged every step (behavior_logprob_gap, behavior_logprob_gap_max,
    behavior_k3_kl)."""

    correction: str = limited("token_tis", choices=CORRECTIONS)
    """'token_tis' / 'sequence_tis': truncated importance weight per token / of the sequence; 'token_mask' /
    'sequence_mask': tokens / sequences whose ratio leaves [band_low, band_high] are dropped from the loss;
    'none'."""
    cap: float = limited(2.0, gt=0)
    """The truncated corrections' cap C."""
    band_low: float = limited(0.5, gt=0)
    """The masking corrections keep ratios in [band_low, band_high]."""
    band_high: float = limited(2.0, gt=0)

    def rules(self) -> list[tuple[str, str]]:
        if self.band_low >= self.band_high:
            return [("band_low", f"({self.band_low}) must be < off_policy.band_high ({self.band_high})")]
        if not self.band_low <= 1.0 <= self.band_high:
            return [("band_low", f"[{self.band_low}, {self.band_high}] must contain 1 (an on-policy token is kept)")]
        return []


@dataclass
class RewardSection:
    """What a sample's reward is made of (``reflow.rewards``): the task's reward functions, weighted and each
    logged (reward_<name>_mean), DAPO's overlong shaping, and DAPO's dynamic sampling."""

    functions: list[str] = field(default_factory=lambda: ["task"])
    """Reward functions of the task, by name: 'task' (its reward), or one the task names (chain_sum: 'answer',
    'steps', 'format'; math and chain_sum_boxed: 'boxed')."""
    weights: list[float] = field(default_factory=list)
    """One weight per function (empty: 1 each); the reward is their weighted sum."""
    overlong_buffer: int = limited(0, ge=0)
    """DAPO's soft overlong punishment: a response longer than rollout.max_new_tokens - overlong_buffer model
    tokens loses reward linearly, overlong_penalty at the cap (0: off)."""
    overlong_penalty: float = limited(1.0, ge=0)
    """The reward lost at the cap."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal is dropped before the replay buffer (it
    carries no gradient), and generation goes on until the batch's fresh share is filled (logged:
    dynamic_sampling_filtered_frac)."""

    def rules(self) -> list[tuple[str, str]]:
        if not self.functions:
            return [("functions", "must name at least one reward function")]
        if self.weights and len(self.weights) != len(self.functions):
            return [("weights", f"has {len(self.weights)} entries for {len(self.functions)} reward.functions")]
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
    yet trained stay within async's window, (delta - weight_sync.interval + 2) batches, or with
    replay.strict_window one batch less plus ceil(b (1 - sigma)) samples (docs/decoupled_protocol.md)."""

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
    strict_window: bool = False
    """'reflow': admit at most steps_ahead x b + ceil(b(1 - sigma)) samples ahead of the trainer (in whole groups)
    instead of async's (steps_ahead + 1) x b. The strict window guarantees that nothing is generated in vain
    (no sample outlives its staleness bound unused), at the price of a rollout that idles more; the default
    keeps the rollout as busy as async's and may evict a few samples (docs/decoupled_protocol.md gives both
    guarantees and the worst case measured)."""
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
            out.append(("filter_reward_low",
                        f"({self.filter_reward_low}) must be <= replay.filter_reward_high ({self.filter_reward_high})"))
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
    """Multi-turn tasks: environment answers per trajectory (tool calls; the coding agent's tested programs); an
    agent task: calls per episode."""
    agent: str = ""
    """task.name = 'agent': the agent, as 'module:function' (an async function (client, row) -> reward that
    talks to the policy through an openai.AsyncOpenAI client: docs/agents.md)."""
    agent_timeout_s: float = limited(300.0, gt=0)
    """task.name = 'agent': wall-clock seconds one episode may take, engine time included; past it the episode
    ends as a failure (reward 0, agent_failure 'timeout')."""
    sandbox_wall_s: float = 10.0
    """Sandboxed code (retool, coding_agent): wall-clock seconds per run."""
    sandbox_cpu_s: float = 5.0
    """Sandboxed code: CPU seconds per run."""
    sandbox_memory_mb: int = 1024
    """Sandboxed code: address space per run (MiB)."""
    sandbox_python: str = ""
    """Sandboxed code: the interpreter that runs it ("": this Python's base interpreter when the unprivileged
    sandbox user can read it, else /usr/bin/python3). Only its standard library is visible to the code."""
    sandbox_allow_without_cgroup: bool = False
    """Sandboxed code where this process can make no per-run cgroup: run it with per-process bounds only (each
    process's address space, file size and open files, the run's process count), which leave a run's kernel
    memory unbounded (tmpfs inodes, pipe and socket buffers). False: such a run refuses to start, saying how to
    get a cgroup (``reflow.envs.sandbox.NO_CGROUP``)."""
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
    Every mode also evaluates a new run's starting policy (eval_policy_version 0); the decoupled modes also the
    final one."""
    eval_num_prompts: int = 64
    """Prompts used by an evaluation."""
    timeline: bool = True
    """Every rank writes what it did when (generate, idle, sync, evaluate, train, wait, transition) to
    <dump_folder>/timeline/; ``python -m reflow.metrics.timeline DUMP`` draws them as one Chrome trace."""
    wandb_project: str = ""
    """Log to Weights & Biases under this project ("": off). The run continues the same W&B run on resume."""
    wandb_entity: str = ""
    """W&B entity (team or user; "": the API key's default)."""
    wandb_run_name: str = ""
    """W&B run name ("": the dump folder's name)."""
    wandb_group: str = ""
    """W&B group (for example the seeds of one experiment)."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags."""
    wandb_mode: str = limited("online", choices=("online", "offline"))
    """'offline': write the W&B run under <dump_folder>/wandb, for ``wandb sync`` later (a node without network)."""

    def wandb_settings(self):
        """The W&B sink's settings, or None when ``wandb_project`` is empty."""
        from reflow.metrics.sinks import WandbSettings

        if not self.wandb_project:
            return None
        return WandbSettings(self.wandb_project, self.wandb_entity, self.wandb_run_name, self.wandb_group,
                             tuple(self.wandb_tags), self.wandb_mode)


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
    planner_memory_steps: int = limited(100, ge=0)
    """Placement planner: steps a placement's own measured rates (production per rollout rank-second,
    consumption per replica-second) stay valid after its last window; a placement with rates of its own is
    predicted from them, not scaled linearly from another's (0: off, every placement from the rates of all
    windows, the linear model alone)."""
    planner_explore_budget: float = limited(0.1, ge=0)
    """Placement planner: a placement never measured, next to the best measured one, is tried while two
    transitions cost at most this fraction of the horizon's predicted seconds (0: only the placements the
    model chooses are measured). Needs planner_memory_steps (reflow/scheduler/planner.py, steps 7 and 8)."""


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSection:
    """LoRA adapters on the policy (``reflow.trainer.lora``): the base model frozen, a low-rank update of the
    target projections trained."""

    rank: int = limited(0, ge=0)
    """Rank r of every adapter (0: no LoRA, the whole model trains)."""
    alpha: float = limited(16.0, gt=0)
    """Each adapter adds (alpha / rank) * B A x."""
    dropout: float = limited(0.0, ge=0, lt=1)
    """Dropout on an adapter's input, in the training forward only."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_PROJECTIONS))
    """The projections of every layer that get an adapter, by their Hugging Face names."""
    train_embeddings: bool = False
    """Train the token embeddings in full beside the adapters."""
    train_head: bool = False
    """Train the output head in full beside the adapters (with tied embeddings: set both or neither)."""
    adapter: str = ""
    """A peft adapter folder to start from (an SFT'd adapter, or a run's adapter_final): its rank, alpha and
    targets must be this section's, its tensors this model's shapes; empty: the adapters start at B = 0."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def syncs_adapters(self) -> bool:
        """The weight sync moves the adapters only, each a new version in the engines (nothing else trains);
        with trained embeddings or head it moves the merged weights."""
        return self.enabled and not (self.train_embeddings or self.train_head)

    def rules(self) -> list[tuple[str, str]]:
        if self.adapter and not self.enabled:
            return [("adapter", f"= {self.adapter!r} needs LoRA on: set lora.rank to the adapter's rank")]
        if not self.target_modules:
            return [("target_modules", "is empty: name the projections to adapt, e.g. [\"q_proj\", \"v_proj\"]")]
        unknown = [name for name in self.target_modules if name not in LORA_PROJECTIONS]
        if unknown:
            return [("target_modules", f"{unknown} match no projection (use {', '.join(LORA_PROJECTIONS)})")]
        if len(set(self.target_modules)) != len(self.target_modules):
            return [("target_modules", f"names a projection twice: {self.target_modules}")]
        return []


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    loss: LossSection = field(default_factory=LossSection)
    kl: KLSection = field(default_factory=KLSection)
    off_policy: OffPolicySection = field(default_factory=OffPolicySection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    task: TaskSection = field(default_factory=TaskSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    lora: LoraSection = field(default_factory=LoraSection)
