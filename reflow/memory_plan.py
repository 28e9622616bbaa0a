"""What each rank of a run holds in device memory, and in pinned host memory, before anything is allocated.

``memory_plan(cfg, recipe, placement)`` is pure arithmetic on the config, the model's architecture and the
placement: ``python -m reflow.train --dry-run`` prints it, and ``--check`` and every rank at start-up refuse a
run whose plan does not fit the device the recipe names, with one line that names the term that does not fit
and the knob that shrinks it.

A rank is in one of three roles, each with the phases it passes through:
  trainer   (decoupled modes)  train: the trainer's terms below, next to its engine asleep (every rank holds
                               an engine, so that the elastic pool can move it to the rollout side)
  rollout   (decoupled modes)  generate: the engine's budget, ``rollout.gpu_memory_utilization`` of the device
  colocated (sync mode)        generate: the engine's budget, the trainer's state parked in pinned host memory
                               (``training.offload_while_generating``; else it stays); train: the trainer's
                               terms, the engine asleep

The trainer's terms, per rank, for N parameters over a shard degree S (FSDP2 keeps float32 shards, gradients
and AdamW state; ``training.param_dtype`` is what it gathers in, p bytes a value):
  parameter shards          4 N / S              (LoRA: 4 T / S + p (N - T) / S, the frozen base kept in p)
  gradient shards           4 N / S              (LoRA: 4 T / S, T the trained parameters: the adapters, and
                                                 the embeddings and head when lora trains them)
  AdamW moments             8 N / S              (exp_avg and exp_avg_sq; LoRA: 8 T / S)
  reference shards          4 N / S              (only with ``kl.coef`` > 0)
  gathered parameters       p (R + 2 L) x 2      the root unit R (embeddings, head and final norm: it stays
                                                 gathered from the forward to the end of the backward) and
                                                 two transformer blocks of L parameters (the one computing,
                                                 the one prefetched), each with its unsharded gradient
  activations               per micro-batch of b rows of ``rollout.max_model_len`` tokens (t = b x len):
                            without checkpointing  t x layers x a      with full checkpointing  t x (layers x
                            p x dim + a), a block's input kept for each layer and one block recomputed, where
                            a = p (3 dim + 3 q + 3 kv + 4 hidden) bytes per token and layer (the norms'
                            inputs, q/k/v with their norms, the attention output, the MLP's gate, up, its
                            activation and their product; q = heads x head_dim, kv = kv_heads x head_dim)
  log-prob workspace        t x dim x p (the final hidden states) + c x vocab x (p + 20): one chunk of c =
                            ``training.logprob_chunk_tokens`` tokens' logits, their float32 copy, the
                            log-softmax's exponentials and, in the backward pass, their gradient; the
                            entropy's softmax and its product with the logits (logged every step)

The engine's terms, per engine rank, with tensor-parallel degree T (bf16 weights, 2 bytes a value):
  weights                   2 N / T
  non-KV reserve            ENGINE_RESERVE_GIB: vLLM's profiling forward, the sampler, CUDA graphs
  KV cache                  the rest of the budget, ``gpu_memory_utilization`` x the device; it must hold at
                            least one sequence of ``rollout.max_model_len`` tokens (vLLM refuses to start
                            otherwise), at 4 x layers x max(kv_heads / T, 1) x head_dim bytes a token
  asleep                    ENGINE_ASLEEP_GIB (sleep level 1 offloads the weights to pinned host memory and
                            frees the cache, level 2 drops both; the allocator's pools and CUDA graphs stay)

Every phase on a GPU also holds the CUDA context and the NCCL communicators the rank has joined
(``CUDA_CONTEXT_GIB`` + ``NCCL_COMMUNICATOR_GIB`` each: the world, the trainer's shard and replica groups, the
weight-sync group), and the weight sync adds a phase of its own:
  sync (trainer, colocated) the trainer's resident terms (a colocated rank's optimizer parked, its engine's
                            weights mapped to receive), and the sync's buckets in flight: 2 x
                            ``weight_sync.bucket_size_mb`` in the engine's dtype (the bucket's all-gather output
                            and the flat copy the broadcast sends; the cast shards are 1/S of that)

Pinned host memory, allocated at its exact size above 16 MiB (``reflow.distributed.host_memory.
exact_pinned_allocations``: PyTorch would round each allocation up to a power of two, 1.37x for an 8B
trainer's shards) and held for the whole run:
  parked trainer state      a colocated rank's parameter shards, AdamW moments and reference (gradients are freed
                            after each update), in buffers allocated at the first parking and reused every step
  engine weight backup      an asleep engine's weights at level 1: a decoupled trainer rank's (asleep while it
                            trains), and a colocated rank's when ``weight_sync.interval`` > 1 (it sleeps at level
                            1 every step). Elsewhere a wake hands the backup back to the OS (the start-up sleep's
                            included); with a sync after every step sync mode's engine sleeps at level 2: the reload
                            overwrites the weights, so none are kept
A phase fits when its sum is at most ``USABLE_FRACTION`` of the device (the caching allocator's fragmentation
takes the rest). The context, communicator and reserve constants are estimates until the device probe
(``scripts/gpu_probe.py``) measures them on the GPU a recipe names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1024**3
ENGINE_RESERVE_GIB = 2.0
"""vLLM's memory outside the weights and the KV cache on a GPU: the activations of its profiling forward over
``max_num_batched_tokens``, the sampler's buffers and the CUDA graphs (1-3 GiB for 4B-32B models)."""
ENGINE_ASLEEP_GIB = 1.0
"""What a sleeping engine keeps on the device (the allocator's pools, CUDA graphs)."""
USABLE_FRACTION = 0.97
"""Of the device's memory, what a phase may plan to use: the caching allocator's fragmentation takes the rest."""
CUDA_CONTEXT_GIB = 0.75
"""The CUDA context with PyTorch's kernels loaded, cuBLAS's workspace and the caching allocator's first blocks
(0.5-0.8 GiB on an H100 with CUDA 12-13)."""
NCCL_COMMUNICATOR_GIB = 0.25
"""One NCCL communicator's buffers on a rank (NCCL_BUFFSIZE 4 MiB per channel and peer, plus its proxies)."""


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    knob: str
    """The config key that shrinks it (or moves it elsewhere)."""


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[Term, ...]

    @property
    def bytes(self) -> int:
        return sum(term.bytes for term in self.terms)


@dataclass(frozen=True)
class RolePlan:
    role: str
    """'trainer', 'rollout' or 'colocated'."""
    ranks: int
    phases: tuple[Phase, ...]
    pinned_host_bytes: int = 0
    kv_tokens: int | None = None
    """Tokens the engine's KV cache holds (None: no awake engine)."""

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.bytes)


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    device_bytes: int
    """0: not known (a CPU recipe: host memory, not checked)."""
    roles: tuple[RolePlan, ...]
    gpus_per_node: int = 8
    problems: tuple[str, ...] = field(default=())
    """One line per term that does not fit: the role, the phase, the term and the knob."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def pinned_host_bytes_per_rank(self) -> int:
        """The most one rank pins: the role that pins the most."""
        return max((role.pinned_host_bytes for role in self.roles), default=0)

    def pinned_host_bytes_per_node(self) -> int:
        """The most a node's ranks pin, if its ranks all have the role that pins the most."""
        return self.pinned_host_bytes_per_rank() * self.gpus_per_node

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "device_gib": round(self.device_bytes / GIB, 2),
            "usable_gib": round(USABLE_FRACTION * self.device_bytes / GIB, 2),
            "fits": self.fits,
            "problems": list(self.problems),
            "pinned_host_gib_per_node": round(self.pinned_host_bytes_per_node() / GIB, 2),
            "roles": {
                role.role: {
                    "ranks": role.ranks,
                    "peak_phase": role.peak.name,
                    "peak_gib": round(role.peak.bytes / GIB, 2),
                    "pinned_host_gib": round(role.pinned_host_bytes / GIB, 2),
                    **({"kv_cache_tokens": role.kv_tokens} if role.kv_tokens is not None else {}),
                    "phases": {
                        phase.name: {term.name: round(term.bytes / GIB, 3) for term in phase.terms} for phase in role.phases
                    },
                }
                for role in self.roles
            },
        }

    def format(self) -> str:
        lines = [f"memory plan per rank ({self.device}, {self.device_bytes / GIB:.0f} GiB, "
                 f"{USABLE_FRACTION * self.device_bytes / GIB:.1f} GiB usable)" if self.device_bytes else
                 f"memory plan per rank ({self.device}: host memory, not checked)"]
        for role in self.roles:
            lines.append(f"  {role.role} ({role.ranks} ranks), pinned host {role.pinned_host_bytes / GIB:.2f} GiB"
                         + (f", KV cache {role.kv_tokens} tokens" if role.kv_tokens is not None else ""))
            for phase in role.phases:
                lines.append(f"    {phase.name:9s} {phase.bytes / GIB:8.2f} GiB")
                lines.extend(f"      {term.name:24s} {term.bytes / GIB:8.3f} GiB   ({term.knob})" for term in phase.terms)
        lines.extend(f"  does not fit: {problem}" for problem in self.problems)
        return "\n".join(lines)


def _dtype_bytes(name: str) -> int:
    return 2 if name in ("bfloat16", "float16") else 4


def lora_parameters(arch, lora) -> int:
    """The adapters' parameters: r (in + out) per adapted projection per layer ([lora])."""
    q, kv = arch.n_heads * arch.head_dim, arch.n_kv_heads * arch.head_dim
    sides = {"q_proj": arch.dim + q, "k_proj": arch.dim + kv, "v_proj": arch.dim + kv, "o_proj": q + arch.dim,
             "gate_proj": arch.dim + arch.hidden_dim, "up_proj": arch.dim + arch.hidden_dim,
             "down_proj": arch.hidden_dim + arch.dim}
    return arch.n_layers * lora.rank * sum(sides[name] for name in lora.target_modules)


def trained_parameters(cfg, arch, num_params: int) -> int:
    """What has gradients and AdamW state: the whole model, or a LoRA run's adapters (and the embeddings and
    head where it trains them)."""
    lora = cfg.lora
    if not lora.enabled:
        return num_params
    embeddings = arch.vocab_size * arch.dim
    full = (embeddings if lora.train_embeddings else 0) + (
        embeddings if lora.train_head and not (arch.tie_embeddings and lora.train_embeddings) else 0)
    return lora_parameters(arch, lora) + full


def trainer_terms(cfg, arch, num_params: int, shard_degree: int) -> list[Term]:
    """The trainer's terms on one rank (see the module's docstring)."""
    training = cfg.training
    param = _dtype_bytes(training.param_dtype)
    if cfg.lora.enabled:
        num_params += lora_parameters(arch, cfg.lora)
    per_shard = num_params / shard_degree
    trained_per_shard = trained_parameters(cfg, arch, num_params) / shard_degree
    root = arch.vocab_size * arch.dim * (1 if arch.tie_embeddings else 2) + arch.dim
    block = (num_params - root) / arch.n_layers
    # one pass's padded tokens: micro_batch_size rows of the longest length, or the token budget's bound on them
    tokens = training.micro_batch_size * cfg.rollout.max_model_len
    if training.micro_batch_tokens:
        tokens = min(tokens, max(training.micro_batch_tokens, cfg.rollout.max_model_len))
    q, kv = arch.n_heads * arch.head_dim, arch.n_kv_heads * arch.head_dim
    per_token_layer = param * (3 * arch.dim + 3 * q + 3 * kv + 4 * arch.hidden_dim)
    if training.activation_checkpointing == "full":
        activations = tokens * (arch.n_layers * param * arch.dim + per_token_layer)
    else:
        activations = tokens * arch.n_layers * per_token_layer
    chunk = training.logprob_chunk_tokens if training.logprob_chunk_tokens > 0 else tokens
    chunk = min(chunk, tokens)
    terms = [
        # (a LoRA run keeps its frozen base in the gather dtype: reflow.trainer.lora.store_frozen_in)
        Term("parameter shards", int(4 * trained_per_shard + param * (per_shard - trained_per_shard)) if cfg.lora.enabled
             else int(4 * per_shard), "placement.trainer_shard_degree"),
        Term("gradient shards", int(4 * trained_per_shard), "placement.trainer_shard_degree / lora.rank"),
        Term("AdamW moments", int(8 * trained_per_shard), "placement.trainer_shard_degree / lora.rank"),
    ]
    if cfg.kl.coef > 0:
        terms.append(Term("reference shards", int(4 * per_shard), "kl.coef"))
    terms += [
        Term("gathered parameters", int(2 * param * (root + 2 * block)), "training.param_dtype"),
        Term("activations", int(activations),
             "training.micro_batch_size / training.micro_batch_tokens / training.activation_checkpointing"),
        Term("log-prob workspace", int(tokens * arch.dim * param + chunk * arch.vocab_size * (param + 20)),
             "training.logprob_chunk_tokens"),
    ]
    return terms


def communicators(role: str) -> int:
    """NCCL communicators a rank of ``role`` uses (NCCL creates one at a group's first collective): the world,
    the trainer's shard and replica groups, the weight-sync group (colocated: none, each rank feeds its own
    engine)."""
    return {"colocated": 3, "trainer": 4, "rollout": 2}[role]


def sync_buckets_term(cfg, arch) -> Term:
    """The weight sync's buckets in flight on a trainer rank (see the module's docstring): a bucket holds
    ``weight_sync.bucket_size_mb`` of bf16 values, or one tensor when a tensor is larger (the embeddings); a
    LoRA run's adapter sync gathers every adapter at once, in bf16."""
    if cfg.lora.syncs_adapters:
        return Term("adapter sync", 2 * 2 * lora_parameters(arch, cfg.lora), "lora.rank")
    bucket = max(int(cfg.weight_sync.bucket_size_mb * 2**20), 2 * arch.vocab_size * arch.dim)
    return Term("weight-sync buckets", 2 * bucket, "weight_sync.bucket_size_mb")


def kv_bytes_per_token(arch, tensor_parallel: int) -> int:
    """K and V, bf16, every layer, this rank's share of the KV heads (replicated when T exceeds them)."""
    heads = max(arch.n_kv_heads // tensor_parallel, 1)
    return 2 * 2 * arch.n_layers * heads * arch.head_dim


def memory_plan(cfg, recipe, placement) -> MemoryPlan:
    """Every role's phases for this run, on a GPU of ``placement.gpu_memory_gib`` (0: the recipe's)."""
    arch, num_params = recipe.architecture, recipe.num_params
    on_gpu = recipe.device == "cuda"
    device_gib = cfg.placement.gpu_memory_gib or recipe.parallelism.gpu_memory_gib
    device_bytes = int(device_gib * GIB) if on_gpu else 0
    tp = placement.rollout_tp
    engine_weights = Term("engine weights", int(2 * num_params / tp), "rollout.tensor_parallel_degree")
    if cfg.lora.syncs_adapters:  # the base, and a LoRA run's adapter versions (as many as RolloutEngine batches)
        from reflow.config.mode_settings import resolve_settings

        settings = None if cfg.training.mode == "sync" else resolve_settings(cfg)
        versions = (0 if settings is None else settings.max_head_lag or settings.delta) + 2
        engine_weights = Term("engine weights and adapters",
                              engine_weights.bytes + int(2 * versions * lora_parameters(arch, cfg.lora) / tp),
                              "rollout.tensor_parallel_degree / lora.rank")
    asleep = Term("engine asleep", int(ENGINE_ASLEEP_GIB * GIB) if on_gpu else 0, "(vLLM's pools while asleep)")
    problems: list[str] = []

    def on_device(role: str) -> tuple[Term, ...]:
        """The CUDA context and the role's NCCL communicators (on a GPU)."""
        if not on_gpu:
            return ()
        gib = CUDA_CONTEXT_GIB + NCCL_COMMUNICATOR_GIB * communicators(role)
        return (Term("CUDA context, NCCL", int(gib * GIB), "(measured by scripts/gpu_probe.py)"),)

    def engine_phase(extra: list[Term], role: str) -> tuple[Phase, int | None]:
        if not on_gpu:
            return Phase("generate", (engine_weights, *extra)), None
        budget = int(cfg.rollout.gpu_memory_utilization * device_bytes)
        reserve = Term("engine non-KV reserve", int(ENGINE_RESERVE_GIB * GIB), "rollout.max_num_seqs")
        kv = budget - engine_weights.bytes - reserve.bytes
        per_token = kv_bytes_per_token(arch, tp)
        tokens = max(kv, 0) // per_token
        if tokens < cfg.rollout.max_model_len:
            problems.append(
                f"the engine's KV cache: {max(kv, 0) / GIB:.1f} GiB is left of its {budget / GIB:.1f} GiB budget "
                f"(rollout.gpu_memory_utilization = {cfg.rollout.gpu_memory_utilization}) after {engine_weights.bytes / GIB:.1f} "
                f"GiB of weights and {reserve.bytes / GIB:.1f} GiB of reserve, less than one sequence of "
                f"rollout.max_model_len = {cfg.rollout.max_model_len} tokens: raise rollout.tensor_parallel_degree "
                f"(now {tp}) or rollout.gpu_memory_utilization"
            )
        cache = Term("KV cache", max(kv, 0), "rollout.gpu_memory_utilization")
        return Phase("generate", (engine_weights, reserve, cache, *extra, *on_device(role))), tokens

    trainer = trainer_terms(cfg, arch, num_params, placement.shard_degree)
    parked = sum(term.bytes for term in trainer if term.name in ("parameter shards", "AdamW moments", "reference shards"))
    buckets = sync_buckets_term(cfg, arch)
    resident = tuple(term for term in trainer if term.name in ("parameter shards", "AdamW moments", "reference shards"))
    roles = []
    if placement.colocated:
        offload = on_gpu and cfg.training.offload_while_generating
        stays = [] if offload else [Term("trainer state", parked, "training.offload_while_generating")]
        generate, tokens = engine_phase(stays, "colocated")
        # the sync: the parameters back on the device (the optimizer and reference stay parked when offloading),
        # the engine's weights mapped to receive them, its KV cache asleep
        kept = tuple(term for term in resident if term.name == "parameter shards" or not offload)
        sync = Phase("sync", (*kept, engine_weights, asleep, buckets, *on_device("colocated")))
        # the engine sleeps at level 2 (its weights dropped, not pinned) before a step that a sync follows
        keeps_weights = cfg.weight_sync.interval > 1
        roles.append(RolePlan("colocated", placement.world_size,
                              (generate, Phase("train", (*trainer, asleep, *on_device("colocated"))), sync),
                              pinned_host_bytes=(parked if offload else 0) + engine_weights.bytes * on_gpu * keeps_weights,
                              kv_tokens=tokens))
    else:
        roles.append(RolePlan("trainer", placement.num_trainer_ranks,
                              (Phase("train", (*trainer, asleep, *on_device("trainer"))),
                               Phase("sync", (*resident, asleep, buckets, *on_device("trainer")))),
                              pinned_host_bytes=engine_weights.bytes * on_gpu))
        generate, tokens = engine_phase([], "rollout")
        roles.append(RolePlan("rollout", placement.num_rollout_ranks, (generate,), kv_tokens=tokens))
    if on_gpu:
        usable = USABLE_FRACTION * device_bytes
        for role in roles:
            for phase in role.phases:
                if phase.bytes > usable:
                    largest = max(phase.terms, key=lambda term: term.bytes)
                    problems.append(
                        f"a {role.role} rank's {phase.name} phase needs {phase.bytes / GIB:.1f} GiB of the device's "
                        f"{usable / GIB:.1f} usable GiB; its largest term is {largest.name}, {largest.bytes / GIB:.1f} "
                        f"GiB: change {largest.knob}"
                    )
    return MemoryPlan(recipe.device, device_bytes, tuple(roles), recipe.parallelism.gpus_per_node, tuple(problems))
