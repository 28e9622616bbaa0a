"""The trainer engine: one FSDP2 shard of the policy (and optimizer) per trainer rank.

Build steps, in order (``PolicyTrainer.__init__``):
  1. model config from the recipe; model on the meta device
  2. FSDP2 over the trainer mesh (HSDP when the mesh is 2-D)
  3. materialize on the device, init buffers (no parameter init), load the Hugging Face checkpoint
  4. optional frozen reference copy (for the KL penalty)
  5. AdamW over the sharded parameters

A ``train_step`` recomputes the log-probs of the batch under the current
weights (the PPO "old" log-probs; with a single update per batch they are the
new ones, detached, and no extra forward runs unless the off-policy correction
masks tokens), then runs ``ppo_epochs`` x ``num_minibatches`` optimizer updates
in micro-batches of the run's algorithm (``reflow.algorithms``): its policy
loss times the off-policy weight, the KL and entropy terms, aggregated with the
replay weights over every data-parallel rank, at the schedule's learning rate.
Every trainer rank must call the collective methods together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from reflow.algorithms.kl import kl_estimate, kl_shaped_advantages
from reflow.algorithms.off_policy import mismatch
from reflow.algorithms.settings import Objective, lr_schedule
from reflow.algorithms.settings import objective as run_objective
from reflow.config.job_config import JobConfig, LoraSection, TrainingSection
from reflow.distributed.buckets import broadcast_tensors
from reflow.distributed.utils import TrainerLayout
from reflow.model.qwen3 import build_model_config, build_on_meta, init_buffers
from reflow.model.recipe import Recipe, resolve_path
from reflow.trainer.batch import TrainBatch, index, plan_micro_batches, zero_batch
from reflow.trainer.elastic import (
    adopt,
    carry_optimizer_state,
    local_shards,
    release,
    shard_tensors,
    zero_optimizer_state,
    zero_shards,
)
from reflow.trainer.hf_io import build_adapter, export_hf, export_peft_adapter, load_hf_into
from reflow.trainer.logprobs import chunked_token_logprobs
from reflow.trainer.lora import (
    apply_lora,
    build_adapter_plan,
    init_lora,
    load_adapter_folder,
    model_projections,
    store_frozen_in,
    trainable_parameters,
)
from reflow.trainer.offload import HostParking
from reflow.trainer.parallelize import (
    apply_block_compile,
    apply_fsdp,
    apply_full_activation_checkpointing,
    refuse_eager_fallback,
)
from reflow.types import ResizeReport


@dataclass
class StepStats:
    """One train step's figures over every trainer rank (token means over the loss tokens of the last pass)."""

    loss: float
    num_tokens: int
    num_samples: int
    grad_norm: float
    """The gradient norm before clipping (mean over the step's updates)."""
    grad_norm_clipped: float
    """After clipping: min(grad_norm, training.max_norm) per update."""
    lr: float
    """The learning rate of the step's last update (``training.warmup_steps``, ``training.lr_decay``)."""
    clip_fraction: float
    is_weight_mean: float
    """Mean off-policy weight on the tokens that trained."""
    kl_ref: float
    """Mean of the kl.estimator's value against the reference (0 without one)."""
    entropy: float
    """Mean policy entropy per token (nats)."""
    behavior_kl: float
    """Mean of (logp_old - logp_behavior) over tokens: how far vLLM's sampling distribution is from the trainer's."""
    behavior_k3_kl: float
    """K3 estimate of KL(behavior || trainer) per token."""
    max_abs_logprob_diff: float
    off_policy_dropped_frac: float = 0.0
    """Loss tokens the masking off-policy correction dropped, as a share of the batch's loss tokens."""
    skipped_updates: int = 0
    """Optimizer updates of the step skipped for a non-finite loss or gradient norm."""
    pass_tokens: int = 0
    """The busiest trainer rank's token slots in its forward/backward passes, summed over the step's updates:
    each micro-batch's rows times its width (its longest row), the zero-weight padding passes included. What
    a train step's compute scales with: a long-tailed batch pads its passes to their longest rows, and
    fewer rows per rank (more trainer ranks) pad more per token (``reflow.sim`` charges these)."""

    def as_row(self) -> dict:
        """The step row's keys (``reflow.modes.base.step_metrics``)."""
        row = asdict(self)
        for step_level in ("loss", "num_tokens", "num_samples"):
            row.pop(step_level)
        row["behavior_logprob_gap"] = row.pop("behavior_kl")
        row["behavior_logprob_gap_max"] = row.pop("max_abs_logprob_diff")
        row["entropy_mean"] = row.pop("entropy")
        row["train_pass_tokens"] = row.pop("pass_tokens")
        return row


class PolicyTrainer:
    """This rank's share of the trainer: an FSDP2 shard of the policy (and of the frozen reference), AdamW
    over it, and the FSDP skeletons of every other placement this rank can join (``resize``).

    ``layouts`` holds every trainer placement the run may use, by replica count, all built at startup;
    ``replicas`` is the one the run starts on. A rank outside it starts without storage (``active`` False)."""

    def __init__(
        self, training: TrainingSection, attention: str, objective: Objective, recipe: Recipe, hf_dir: str,
        layouts: dict[int, TrainerLayout], replicas: int, device: torch.device, lora: LoraSection | None = None,
        seed: int = 0,
    ):
        """``training``: the run's [training] section; ``attention``: model.attention; ``objective``: what it optimizes
        (``reflow.algorithms.settings.objective``); ``lora``: the [lora] section (adapters on a frozen base, or
        None / rank 0: the whole model trains), its adapters drawn from ``seed``. ``from_config`` builds them
        from a run's config."""
        self.training = training
        self.attention = attention
        self.device = device
        self.rank = dist.get_rank()
        # the run's algorithm (``reflow.algorithms``)
        self.objective = objective
        self.temperature = objective.temperature
        self.policy_loss = objective.policy_loss
        self.aggregation = objective.aggregation
        self.correction = objective.correction
        self.schedule = lr_schedule(training)
        self.layouts = layouts
        self.layout = layouts[replicas]
        # 1. model config
        self.model_config = build_model_config(recipe, attention)
        self.adapter = build_adapter(self.model_config, hf_dir)
        self.hf_dir = hf_dir
        self.lora = lora if lora is not None and lora.enabled else None
        self.lora_scale = self.lora.alpha / self.lora.rank if self.lora is not None else 0.0
        self.projections = model_projections(self.adapter)
        if attention == "flex":  # torchtitan compiles flex attention itself, with or without training.compile
            refuse_eager_fallback()
        # 2. one FSDP skeleton (policy, and reference when the KL penalty is on) per placement this rank can
        #    belong to, on meta: no storage, no communication
        self.skeletons = {n: self._skeleton_pair(layout) for n, layout in layouts.items() if layout.has(self.rank)}
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.num_updates = 0
        # 3. materialize this placement's skeleton and load the checkpoint (trainer ranks at start)
        if self.layout.has(self.rank):
            self.model, self.ref_model = self.skeletons[replicas]
            for module in (self.model, self.ref_model):
                if module is not None:
                    module.to_empty(device=device)
                    with torch.no_grad():
                        init_buffers(module, device)  # every parameter comes from the checkpoint
                    load_hf_into(module, self.adapter, hf_dir, process_group=self.layout.group)
            if self.lora is not None:
                init_lora(self.model, seed)  # after the base: A drawn, B = 0 (the base model, exactly)
                if self.lora.adapter:  # or the adapters of a folder (checked before ranks started)
                    plan = build_adapter_plan(self.model_config, self.adapter, self.lora, hf_dir)
                    load_adapter_folder(self.model, resolve_path(self.lora.adapter), plan)
            # 4. AdamW over the local shards, its state created now so a transfer or a checkpoint can fill it
            self.optimizer = self._new_optimizer(self.model)
            zero_optimizer_state(self.optimizer, self.model)
        # 5. where the state waits while a colocated engine generates (CUDA; on CPU both share host memory)
        self.parking = HostParking(pin=True) if device.type == "cuda" and training.offload_while_generating else None

    @classmethod
    def from_config(
        cls, cfg: JobConfig, recipe: Recipe, hf_dir: str, layouts: dict[int, TrainerLayout], replicas: int,
        device: torch.device,
    ) -> "PolicyTrainer":
        """The trainer of a run: its [training] section, model.attention and ``objective(cfg)``."""
        return cls(cfg.training, cfg.model.attention, run_objective(cfg), recipe, hf_dir, layouts, replicas, device,
                   cfg.lora, cfg.job.seed)

    def _skeleton_pair(self, layout: TrainerLayout) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        training = self.training
        param_dtype = torch.bfloat16 if training.param_dtype == "bfloat16" else torch.float32

        def skeleton(trainable: bool) -> torch.nn.Module:
            module = build_on_meta(self.model_config)
            module._skip_lm_head = True  # forward returns the final hidden states: ``chunked_token_logprobs``
            if trainable and self.lora is not None:  # (before the wrappers: the adapters' paths are the layers')
                apply_lora(module, self.lora, self.projections)
                store_frozen_in(module, param_dtype)  # the frozen base as it is gathered (bf16: half the bytes)
            if trainable and training.activation_checkpointing == "full":
                apply_full_activation_checkpointing(module)
            if trainable and training.compile:  # the reference runs one forward per step: not worth a compile
                apply_block_compile(module)
            module = apply_fsdp(module, layout.mesh, param_dtype)
            if trainable:
                module.train()
            else:
                module.requires_grad_(False)  # the frozen reference
            return module

        return skeleton(True), skeleton(False) if self.objective.kl.coef > 0 else None

    def _new_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        training = self.training
        return torch.optim.AdamW(
            trainable_parameters(model), lr=training.lr, betas=tuple(training.betas), weight_decay=training.weight_decay, eps=1e-8
        )

    @property
    def active(self) -> bool:
        """Does this rank hold a trainer shard in the current placement?"""
        return self.model is not None

    @property
    def group(self):
        """The process group of the current placement's trainer ranks (global sums over data-parallel ranks)."""
        return self.layout.group

    @property
    def mesh(self):
        return self.layout.mesh

    # ---- offload while a colocated engine generates --------------------------------

    def park(self, *what: str) -> int:
        """Move trainer state to host memory (``reflow.trainer.offload``): "optimizer" (AdamW moments and the
        frozen reference: the weight sync does not read them), "parameters". A no-op without ``parking``
        (CPU, or training.offload_while_generating off) and for what is parked already. Returns the bytes."""
        if self.parking is None or not self.active:
            return 0
        moved = 0
        for name in what:
            if name in self.parking:
                continue
            if name == "optimizer":
                tensors = [state[key].to_local() for state in self.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
                tensors += list(local_shards(self.ref_model).values()) if self.ref_model is not None else []
            elif name == "parameters":
                tensors = list(local_shards(self.model).values())
            else:
                raise ValueError(f"park: unknown trainer state {name!r} (use 'optimizer' or 'parameters')")
            moved += self.parking.park(name, tensors)
        if moved and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks go back to the device, for the engine to take
        return moved

    def unpark(self, *what: str) -> int:
        """Parked state back on the device: ``what`` (default everything), before a train step, a checkpoint
        or an export; the weight sync brings back the parameters it reads."""
        if self.parking is None:
            return 0
        return sum(self.parking.unpark(name) for name in (what or ("optimizer", "parameters")))

    # ---- placement changes -----------------------------------------------------

    def resize(self, replicas: int, *, bucket_bytes: int | None) -> "ResizeReport":
        """Move to the trainer layout with ``replicas`` replicas. Every rank of the old and the new layout
        calls it at the same point (others may: it does nothing there). Staying ranks keep their shards
        (zero-copy re-homing), leaving ranks free theirs, joining ranks receive shard s and the optimizer's
        hyper-parameters from replica 0's rank of shard s (``bucket_bytes`` None: one broadcast per tensor).
        Returns what this rank did (``ResizeReport``)."""
        if replicas not in self.layouts:
            raise ValueError(f"no trainer layout with {replicas} replicas was built at startup (have {sorted(self.layouts)})")
        old, new = self.layout, self.layouts[replicas]
        report = ResizeReport(source=old.name, target=new.name)
        if replicas == old.replicas:
            return report
        stays, leaves, joins = (
            old.has(self.rank) and new.has(self.rank),
            old.has(self.rank) and not new.has(self.rank),
            new.has(self.rank) and not old.has(self.rank),
        )
        report.direction = ResizeReport.direction_of(old.replicas, replicas)
        model, reference = self.skeletons[replicas] if new.has(self.rank) else (None, None)
        if stays:
            report.copied_not_aliased = adopt(model, new.mesh, local_shards(self.model))
            if reference is not None:
                adopt(reference, new.mesh, local_shards(self.ref_model))
            optimizer = self._new_optimizer(model)
            carry_optimizer_state(optimizer, model, self.optimizer, self.model, new.mesh)
        elif joins:
            adopt(model, new.mesh, zero_shards(model, self.device))
            if reference is not None:
                adopt(reference, new.mesh, zero_shards(reference, self.device))
            optimizer = self._new_optimizer(model)
            zero_optimizer_state(optimizer, model)
        elif leaves:
            report.bytes_freed = release(shard_tensors(self.model, self.optimizer, self.ref_model))
            model = reference = optimizer = None
            if self.parking is not None:
                self.parking.release()  # nothing parks on this rank until it rejoins
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the freed bytes go back to the device, for vLLM to take
        else:
            optimizer = None
        for module in (model, reference):
            if module is not None:
                with torch.no_grad():
                    init_buffers(module, self.device)
                if joins and self.lora is not None:  # a LoRA trainer's frozen base is the checkpoint's: read, not moved
                    load_hf_into(module, self.adapter, self.hf_dir, alone=True)
        self.model, self.ref_model, self.optimizer, self.layout = model, reference, optimizer, new
        if replicas > old.replicas and new.has(self.rank):
            # grow: shard s's everything, from replica 0's rank of shard s (global rank s), over the new mesh's
            # dp_replicate group of shard s; staying replicas receive what they already hold
            updates = torch.tensor([self.num_updates], dtype=torch.long)  # the minibatch shuffles depend on it
            # (a LoRA trainer's: the adapters and their AdamW state only)
            tensors = shard_tensors(self.model, self.optimizer, self.ref_model, trained_only=self.lora is not None)
            tensors += [updates]
            source = self.rank % new.shard_degree
            group = new.mesh.get_group("dp_replicate")
            report.broadcasts = broadcast_tensors(tensors, source, group, bucket_bytes)
            self.num_updates = int(updates.item())
            # lr, betas, weight decay as the source has them (a resumed checkpoint may have changed them)
            settings = [[{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]]
            dist.broadcast_object_list(settings, src=source, group=group)
            for param_group, setting in zip(self.optimizer.param_groups, settings[0]):
                param_group.update(setting)
            report.tensors = len(tensors)
            if joins:
                report.bytes_moved = sum(t.numel() * t.element_size() for t in tensors)
        return report

    # ---- forward helpers -------------------------------------------------

    def _logprobs(self, model: torch.nn.Module, tokens: torch.Tensor, entropy: str = "none"):
        """Log-probs of ``tokens[:, 1:]``, (B, T-1); with ``entropy`` 'logged' or 'trained' also each position's
        entropy (``chunked_token_logprobs``)."""
        inputs = tokens[:, :-1]  # (B, T-1); one right-padded sequence per row
        masks = None
        if self.attention == "flex":
            # one document per row: the block-causal mask is plain causal
            positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
            masks = model.get_attention_masks(positions)
        # (B, T-1, D): the model stops before its output projection (``_skip_lm_head``, set at build), which
        # runs a chunk of tokens at a time here; the root FSDP unit that holds it stays unsharded from its
        # forward through the backward pass, so the head's weight is the gathered one
        hidden = model(inputs, attention_masks=masks)  # SDPA is causal without masks
        return chunked_token_logprobs(hidden, tokens[:, 1:], model.lm_head, self.temperature,
                                      self.training.logprob_chunk_tokens, entropy)

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[torch.Tensor, TrainBatch]]:
        """(row indices, micro-batch) pairs of one batch (``plan_micro_batches`` under training.micro_batch_size
        and micro_batch_tokens), each micro-batch cut to its own longest row."""
        lengths = batch.loss_mask.shape[1] - batch.loss_mask.flip(-1).argmax(-1)  # last target column + 1
        lengths = torch.where(batch.loss_mask.sum(-1) > 0, lengths, torch.ones_like(lengths))
        tokens_per_row = (lengths + 1).tolist()  # targets kept; tokens need one more column
        plan = plan_micro_batches(tokens_per_row, self.training.micro_batch_size, self.training.micro_batch_tokens)
        out = []
        for members in plan:
            rows = torch.tensor(members, dtype=torch.long)
            out.append((rows, _trim(index(batch, rows), int(lengths[rows].max().item()))))
        return out

    def _padding(self, count: int, template: TrainBatch) -> list[TrainBatch]:
        """Zero-weight micro-batches so every rank of the placement runs as many forward/backward passes
        (FSDP's collectives) as the busiest one. Collective: call it *before* the first real pass. Agreed
        after the local passes, a rank with fewer micro-batches would enter this all-reduce while another
        is still inside a real pass's FSDP all-gather, and the two collectives would cross (a hang until
        the collective timeout: issue 37)."""
        most = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        return [zero_batch(template) for _ in range(int(most.item()) - count)]

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs of every target token under ``model`` (default: the policy). (B, T-1), 0 past a row's end."""
        return self._segment_logprobs([batch], model)[0]

    @torch.no_grad()
    def _segment_logprobs(self, segments: list[TrainBatch], model: torch.nn.Module | None = None) -> list[torch.Tensor]:
        """``compute_logprobs`` of several batches, padded once over all of them: ranks of a placement may
        serve different numbers of virtual ranks, and must still run as many forwards (FSDP all-gathers)."""
        model = model or self.model
        planned = [self._micro_batches(batch) for batch in segments]
        padding = self._padding(sum(len(mbs) for mbs in planned), segments[0])  # agreed before any forward
        outs = []
        for batch, micro_batches in zip(segments, planned):
            out = torch.zeros(batch.size, batch.tokens.shape[1] - 1)
            for rows, mb in micro_batches:
                lp = self._logprobs(model, mb.tokens.to(self.device)).cpu()
                out[rows, : lp.shape[1]] = lp
            outs.append(out)
        for mb in padding:
            self._logprobs(model, mb.tokens.to(self.device))
        return outs

    # ---- one trainer step --------------------------------------------------

    def train_step(self, batch: TrainBatch | list[TrainBatch]) -> StepStats:
        """``ppo_epochs`` x ``num_minibatches`` optimizer updates on this rank's data.

        A list holds the batches of the virtual data-parallel ranks this rank serves, in replica order; each
        is micro-batched on its own and no micro-batch mixes two. When the caller cuts each step's global
        batch into the virtual ranks of the largest placement, each fits one micro-batch per minibatch, the
        loss weights make the token denominator exact in float64, and the replica count changes between 1
        and 2, the gradient sums associate alike in both placements and the trainer's state is bitwise
        independent of the placement (tests/trainer/test_elastic.py). Otherwise (several micro-batches,
        3 or more replicas, whose all-reduce associates differently) it agrees to within float rounding."""
        training = self.training
        segments = batch if isinstance(batch, list) else [batch]
        if not segments:
            raise ValueError("train_step needs at least one batch")
        self.unpark()
        # one update per batch (ppo_epochs = num_minibatches = 1): the policy that would score the "old"
        # log-probs is the one being updated, so they are the new log-probs, detached; no extra forward, unless
        # a masking off-policy correction must know them to decide which tokens train before the update
        single_update = training.ppo_epochs == 1 and training.num_minibatches == 1
        if single_update and not self.correction.masks:
            old_lps = [None] * len(segments)
        else:
            old_lps = self._segment_logprobs(segments)
        # a masking correction: [loss tokens dropped, loss tokens, and the engine mismatch over every loss token
        # before the drop (log-ratio sum, K3 sum), the outliers the mask drops included]
        dropped = torch.zeros(4, dtype=torch.float64)
        dropped_max = torch.zeros(1, dtype=torch.float64)
        if self.correction.masks:
            kept = []
            for seg, old in zip(segments, old_lps):
                keep = seg.loss_mask * self.correction.drop_mask(old, seg.behavior_logprobs, seg.loss_mask)
                gap = mismatch(old, seg.behavior_logprobs, seg.loss_mask)
                dropped += torch.tensor(
                    [(seg.loss_mask.sum() - keep.sum()).item(), gap.tokens, gap.log_ratio_sum, gap.k3_sum], dtype=torch.float64
                )
                dropped_max[0] = max(dropped_max[0].item(), gap.max_abs)
                kept.append(replace(seg, loss_mask=keep))
            segments = kept
        ref_lps = [None] * len(segments)
        if self.ref_model is not None:
            ref_lps = self._segment_logprobs(segments, self.ref_model)
            # FSDP2 keeps a root unit gathered after its forward, for the backward that would follow; the frozen
            # reference has none, so its embeddings and head (2.3 GiB for 8B in bf16) would stay gathered
            # through the policy's update, outside the memory plan
            self.ref_model.reshard()
        totals = torch.zeros(len(_STAT_KEYS), dtype=torch.float64)
        # maxima over the trainer ranks, in one all-reduce: the behaviour log-prob gap, and the token slots of
        # this rank's passes summed over the step's updates (``StepStats.pass_tokens``)
        maxima = torch.zeros(2, dtype=torch.float64)
        grad_norms, clipped_norms = [], []
        skipped = 0
        for epoch in range(training.ppo_epochs):
            chunks = []
            for seg in segments:
                rows = torch.arange(seg.size)
                if training.num_minibatches > 1:  # the same permutation for every virtual rank of a size
                    generator = torch.Generator().manual_seed(self.num_updates * 7919 + epoch)
                    rows = torch.randperm(seg.size, generator=generator)
                chunks.append(torch.tensor_split(rows, training.num_minibatches))
            for minibatch in range(training.num_minibatches):
                parts = [
                    (
                        index(seg, rows[minibatch]), old[rows[minibatch]] if old is not None else None,
                        ref[rows[minibatch]] if ref is not None else None,
                    )
                    for seg, rows, old, ref in zip(segments, chunks, old_lps, ref_lps)
                ]
                stats = self._update(parts)
                skipped += stats.pop("skipped")
                maxima[1] += stats.pop("pass_tokens")
                if epoch == training.ppo_epochs - 1:  # report the last pass
                    grad_norms.append(stats.pop("grad_norm"))
                    clipped_norms.append(stats.pop("grad_norm_clipped"))
                    maxima[0] = max(maxima[0].item(), stats.pop("max_diff"))
                    totals += torch.tensor([stats[k] for k in _STAT_KEYS], dtype=torch.float64)
        dist.all_reduce(totals, group=self.group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        total = dict(zip(_STAT_KEYS, totals.tolist()))
        tokens = max(total["tokens"], 1.0)
        gap_tokens, gap_max = tokens, maxima[0].item()
        if self.correction.masks:  # the mismatch over the tokens before the mask dropped the outliers
            dist.all_reduce(dropped, group=self.group)
            dist.all_reduce(dropped_max, op=dist.ReduceOp.MAX, group=self.group)
            gap_tokens, gap_max = max(dropped[1].item(), 1.0), dropped_max.item()
            total["behavior_kl"], total["behavior_k3"] = dropped[2].item(), dropped[3].item()
        return StepStats(
            loss=total["loss"] / training.num_minibatches,
            num_tokens=int(total["tokens"]),
            num_samples=int(total["samples"]),
            grad_norm=float(sum(grad_norms) / max(len(grad_norms), 1)),
            grad_norm_clipped=float(sum(clipped_norms) / max(len(clipped_norms), 1)),
            lr=self.optimizer.param_groups[0]["lr"],
            clip_fraction=total["clipped"] / tokens,
            is_weight_mean=total["is_weight"] / tokens,
            kl_ref=total["kl"] / tokens,
            entropy=total["entropy"] / tokens,
            behavior_kl=total["behavior_kl"] / gap_tokens,
            behavior_k3_kl=total["behavior_k3"] / gap_tokens,
            max_abs_logprob_diff=gap_max,
            off_policy_dropped_frac=dropped[0].item() / max(dropped[1].item(), 1.0),
            skipped_updates=skipped,
            pass_tokens=int(maxima[1].item()),
        )

    def _update(self, parts: list[tuple[TrainBatch, torch.Tensor | None, torch.Tensor | None]]) -> dict[str, float]:
        """One optimizer update on a minibatch: (batch, old log-probs or None for the detached new ones,
        reference log-probs) per virtual rank, gradients accumulated over their micro-batches. The
        aggregation's denominator is summed over every virtual rank of every trainer rank first, so each
        micro-batch's numerator over it sums to the one big minibatch's loss (``reflow.algorithms.aggregation``)."""
        local_den = sum(self.aggregation.denominator(batch.loss_mask, batch.weights) for batch, _, _ in parts)
        den = torch.as_tensor(local_den, dtype=torch.float64).reshape(1)
        dist.all_reduce(den, group=self.group)
        den_v = max(den.item(), 1e-8)
        stats = dict.fromkeys(_STAT_KEYS, 0.0)
        stats["max_diff"] = 0.0
        planned = [self._micro_batches(batch) for batch, _, _ in parts]
        padding = self._padding(sum(len(mbs) for mbs in planned), parts[0][0])  # agreed before any forward
        for (batch, old_lp, ref_lp), micro_batches in zip(parts, planned):
            for rows, mb in micro_batches:
                width = mb.loss_mask.shape[1]
                mb_old = old_lp[rows, :width] if old_lp is not None else None
                mb_ref = ref_lp[rows, :width] if ref_lp is not None else None
                self._backward(mb, mb_old, mb_ref, den_v, stats)
        for mb in padding:
            self._backward(mb, None, None, den_v, stats, padding=True)
        stats["pass_tokens"] = sum(mb.tokens.numel() for mbs in planned for _, mb in mbs) + sum(
            mb.tokens.numel() for mb in padding
        )
        training = self.training
        lr = training.lr * self.schedule.lr_factor(self.num_updates)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        params = [p for p in self.model.parameters() if p.grad is not None]
        if training.max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, training.max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        # the global norm, the same on every trainer rank: a NaN or inf anywhere in the loss or the gradients
        # shows here, and every rank skips the update together (the parameters and AdamW keep their last state)
        finite = bool(torch.isfinite(norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        stats["grad_norm"] = float(norm)
        # clip_grad_norm_ scales by max_norm / (norm + 1e-6) when that is below 1
        scale = min(1.0, training.max_norm / (float(norm) + 1e-6)) if training.max_norm > 0 else 1.0
        stats["grad_norm_clipped"] = float(norm) * scale
        stats["skipped"] = 0 if finite else 1
        return stats

    def _backward(self, mb: TrainBatch, old_lp, ref_lp, den: float, stats: dict, padding: bool = False) -> None:
        """Forward/backward of one micro-batch; ``old_lp`` None: the detached new log-probs (one update per
        batch); ``padding``: a micro-batch of zero weights that only keeps the ranks' collectives in step.

        Per token: l = w_off * policy_loss + beta k (kl.placement 'loss') - entropy_coef H, with the advantage
        shaped by -beta's return-to-go instead under kl.placement 'reward'; then the aggregation's numerator
        over the global denominator."""
        mb = mb.to(self.device)
        kl, entropy_coef = self.objective.kl, self.objective.entropy_coef
        new_lp, entropy = self._logprobs(self.model, mb.tokens, "trained" if entropy_coef > 0 else "logged")
        if old_lp is None:
            old_lp = new_lp.detach()
        if padding:  # any finite values do: the weights and the mask are zero
            ref_lp = new_lp.detach() if self.ref_model is not None else None
        old_lp = old_lp.to(self.device)
        ref_lp = ref_lp.to(self.device) if ref_lp is not None else None
        mask = mb.loss_mask
        advantages = mb.advantages
        if kl.coef > 0 and kl.placement == "reward":  # a reward fixed for the step: from the step-start log-probs
            advantages = kl_shaped_advantages(advantages, old_lp, ref_lp, mask, kl.coef, kl.estimator)
        policy = self.policy_loss(new_lp, old_lp, advantages, mask)
        off_policy = self.correction.weights(old_lp, mb.behavior_logprobs, mask)
        token_loss = off_policy * policy.loss
        kl_value = None
        if kl.coef > 0:
            kl_value = kl_estimate(new_lp, ref_lp, kl.estimator)
            if kl.placement == "loss":
                token_loss = token_loss + kl.coef * kl_value
        if entropy_coef > 0:
            token_loss = token_loss - entropy_coef * entropy
        loss_sum = self.aggregation.numerator(token_loss, mask, mb.weights)
        # FSDP sums gradients over every data-parallel rank (pure SUM, no averaging): dividing by the global
        # denominator gives the aggregation of the whole minibatch, whatever the placement
        (loss_sum / den).backward()
        gap = mismatch(old_lp, mb.behavior_logprobs, mask)
        stats["loss"] += loss_sum.item() / den
        stats["tokens"] += gap.tokens
        stats["clipped"] += (policy.clipped * mask).sum().item()
        stats["is_weight"] += (off_policy * mask).sum().item()
        stats["kl"] += (kl_value.detach() * mask).sum().item() if kl_value is not None else 0.0
        stats["entropy"] += (entropy.detach() * mask).sum().item()
        stats["behavior_kl"] += gap.log_ratio_sum
        stats["behavior_k3"] += gap.k3_sum
        stats["max_diff"] = max(stats["max_diff"], gap.max_abs)
        stats["samples"] += (mask.sum(-1) > 0).sum().item()

    # ---- weights out ---------------------------------------------------------

    def export_hf(self, out_dir: str) -> None:
        """The policy as a HF folder (``reflow.trainer.hf_io.export_hf``): every rank of the placement calls, and
        the shards are written by the ranks in turn."""
        self.unpark()
        export_hf(self.model, self.adapter, out_dir, self.hf_dir, group=self.group, lora_scale=self.lora_scale)

    def export_adapter(self, out_dir: str) -> int:
        """A LoRA policy's adapters as a ``peft`` folder (``reflow.trainer.hf_io.export_peft_adapter``) for the
        source checkpoint; every rank of the placement calls."""
        if self.lora is None:
            raise ValueError("export_adapter: this policy has no LoRA adapters (lora.rank = 0)")
        self.unpark()
        return export_peft_adapter(self.model, self.adapter, self.model_config, out_dir, self.hf_dir, self.lora,
                                   group=self.group)

    # ---- Stateful (distributed checkpoint) -------------------------------------

    def state_dict(self) -> dict:
        self.unpark()
        opts = StateDictOptions()
        return {
            "model": get_model_state_dict(self.model, options=opts),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=opts),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.num_updates = int(state["num_updates"])


def _trim(batch: TrainBatch, width: int) -> TrainBatch:
    """Keep the first ``width`` target columns (and width + 1 token columns)."""
    return TrainBatch(
        tokens=batch.tokens[:, : width + 1],
        loss_mask=batch.loss_mask[:, :width],
        behavior_logprobs=batch.behavior_logprobs[:, :width],
        versions=batch.versions[:, :width],
        advantages=batch.advantages,
        weights=batch.weights,
        rewards=batch.rewards,
    )


_STAT_KEYS = ("loss", "tokens", "clipped", "is_weight", "kl", "entropy", "behavior_kl", "behavior_k3", "samples")
