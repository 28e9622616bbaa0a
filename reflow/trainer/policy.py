"""The trainer engine: one FSDP2 shard of the policy (and optimizer) per trainer rank.

Build steps, in order (``PolicyTrainer.__init__``):
  1. model config from the recipe; model on the meta device
  2. FSDP2 over the trainer mesh (HSDP when the mesh is 2-D)
  3. materialize on the device, init buffers (no parameter init), load the Hugging Face checkpoint
  4. optional frozen reference copy (for the KL penalty)
  5. AdamW over the sharded parameters

A ``train_step`` recomputes the log-probs of the batch under the current
weights (the PPO "old" log-probs), then runs ``ppo_epochs`` x
``num_minibatches`` optimizer updates of the GRPO loss in micro-batches.
Every trainer rank must call the collective methods together.
"""

from __future__ import annotations

from dataclasses import dataclass

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

from reflow.algorithms.grpo import LossConfig, loss_denominator, token_loss_terms, weighted_token_sum
from reflow.config.job_config import JobConfig
from reflow.model.qwen3 import build_model_config, build_on_meta, init_buffers
from reflow.model.recipe import Recipe
from reflow.trainer.batch import TrainBatch, index, zero_batch
from reflow.trainer.hf_io import build_adapter, export_hf, load_hf_into
from reflow.trainer.parallelize import apply_fsdp


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target) under softmax(logits / T). logits (B, T, V), targets (B, T) -> (B, T)

    Computed as logit[target] - logsumexp(logits): one full-vocabulary fp32 copy, not three."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@dataclass
class StepStats:
    loss: float
    num_tokens: int
    num_samples: int
    grad_norm: float
    clip_fraction: float
    is_weight_mean: float
    kl_ref: float
    behavior_kl: float
    """Mean of (logp_old - logp_behavior) over tokens: how far vLLM's sampling distribution is from the trainer's."""
    max_abs_logprob_diff: float


class PolicyTrainer:
    def __init__(self, cfg: JobConfig, recipe: Recipe, hf_dir: str, mesh, group, device: torch.device):
        self.cfg = cfg
        self.mesh = mesh
        self.group = group
        self.device = device
        self.dp_size = dist.get_world_size(group)
        self.temperature = cfg.rollout.temperature
        t = cfg.training
        self.loss_cfg = LossConfig(
            clip_eps_low=t.clip_eps,
            clip_eps_high=t.clip_eps_high if t.clip_eps_high > 0 else t.clip_eps,
            is_cap=t.is_truncation,
            kl_coef=t.kl_coef,
        )
        # 1. model config; model on meta
        self.model_config = build_model_config(recipe, cfg.model.attention)
        self.adapter = build_adapter(self.model_config, hf_dir)
        self.hf_dir = hf_dir
        # 2-3. FSDP2, materialize, load
        self.model = self._build_sharded()
        # 4. reference policy (frozen) for the KL penalty
        self.ref_model = self._build_sharded() if t.kl_coef > 0 else None
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)
        # 5. optimizer over the local shards
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, eps=1e-8
        )
        self.num_updates = 0

    def _build_sharded(self) -> torch.nn.Module:
        model = build_on_meta(self.model_config)
        apply_fsdp(model, self.mesh)
        model.to_empty(device=self.device)
        with torch.no_grad():
            init_buffers(model, self.device)  # every parameter comes from the checkpoint below
        load_hf_into(model, self.adapter, self.hf_dir, process_group=self.group)
        model.train()
        return model

    # ---- forward helpers -------------------------------------------------

    def _logprobs(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        inputs = tokens[:, :-1]  # (B, T-1); one right-padded sequence per row
        masks = None
        if self.cfg.model.attention == "flex":
            # one document per row: the block-causal mask is plain causal
            positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
            masks = model.get_attention_masks(positions)
        logits = model(inputs, attention_masks=masks)  # (B, T-1, V); SDPA is causal without masks
        return token_logprobs(logits, tokens[:, 1:], self.temperature)

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[torch.Tensor | None, TrainBatch]]:
        """(row indices, micro-batch) pairs, rows grouped by length and each micro-batch cut to its own
        longest row, so a long-tail straggler pads only its neighbours. Padded with zero-weight rows
        (indices None) so every rank runs the same number of forward/backward passes."""
        mbs = self.cfg.training.micro_batch_size
        lengths = batch.loss_mask.shape[1] - batch.loss_mask.flip(-1).argmax(-1)  # last target column + 1
        lengths = torch.where(batch.loss_mask.sum(-1) > 0, lengths, torch.ones_like(lengths))
        order = torch.argsort(lengths, stable=True)
        local = []
        for i in range(0, batch.size, mbs):
            rows = order[i : i + mbs]
            width = int(lengths[rows].max().item())  # targets kept; tokens need one more column
            mb = index(batch, rows)
            local.append((rows, _trim(mb, width)))
        count = torch.tensor([len(local)], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        while len(local) < int(count.item()):
            local.append((None, zero_batch(batch)))
        return local

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs of every target token under ``model`` (default: the policy). (B, T-1), 0 past a row's end."""
        model = model or self.model
        out = torch.zeros(batch.size, batch.tokens.shape[1] - 1)
        for rows, mb in self._micro_batches(batch):
            lp = self._logprobs(model, mb.tokens.to(self.device)).cpu()
            if rows is not None:
                out[rows, : lp.shape[1]] = lp
        return out

    # ---- one trainer step --------------------------------------------------

    def train_step(self, batch: TrainBatch) -> StepStats:
        t = self.cfg.training
        old_lp = self.compute_logprobs(batch)
        ref_lp = self.compute_logprobs(batch, self.ref_model) if self.ref_model is not None else None
        totals = torch.zeros(len(_STAT_KEYS), dtype=torch.float64)
        max_diff = torch.zeros(1, dtype=torch.float64)
        grad_norms = []
        idx = torch.arange(batch.size)
        for epoch in range(t.ppo_epochs):
            if t.num_minibatches > 1:
                g = torch.Generator().manual_seed(self.num_updates * 7919 + epoch)
                idx = torch.randperm(batch.size, generator=g)
            for chunk in torch.tensor_split(idx, t.num_minibatches):
                stats = self._update(
                    index(batch, chunk), old_lp[chunk], ref_lp[chunk] if ref_lp is not None else None
                )
                if epoch == t.ppo_epochs - 1:  # report the last pass
                    grad_norms.append(stats.pop("grad_norm"))
                    max_diff[0] = max(max_diff[0].item(), stats.pop("max_diff"))
                    totals += torch.tensor([stats[k] for k in _STAT_KEYS], dtype=torch.float64)
        totals_t = totals
        dist.all_reduce(totals_t, group=self.group)
        dist.all_reduce(max_diff, op=dist.ReduceOp.MAX, group=self.group)
        tokens = max(totals_t[1].item(), 1.0)
        return StepStats(
            loss=totals_t[0].item() / t.num_minibatches,
            num_tokens=int(totals_t[1].item()),
            num_samples=int(totals_t[6].item()),
            grad_norm=float(sum(grad_norms) / max(len(grad_norms), 1)),
            clip_fraction=totals_t[2].item() / tokens,
            is_weight_mean=totals_t[3].item() / tokens,
            kl_ref=totals_t[4].item() / tokens,
            behavior_kl=totals_t[5].item() / tokens,
            max_abs_logprob_diff=max_diff.item(),
        )

    def _update(self, batch: TrainBatch, old_lp: torch.Tensor, ref_lp: torch.Tensor | None) -> dict[str, float]:
        """One optimizer update on a minibatch (gradient accumulation over micro-batches)."""
        den = loss_denominator(batch.loss_mask, batch.weights).to(torch.float64).reshape(1)
        dist.all_reduce(den, group=self.group)
        den_v = max(den.item(), 1e-8)
        stats = dict.fromkeys(_STAT_KEYS, 0.0)
        stats["max_diff"] = 0.0
        for rows, mb in self._micro_batches(batch):
            mb = mb.to(self.device)
            new_lp = self._logprobs(self.model, mb.tokens)
            width = new_lp.shape[1]
            if rows is not None:
                mb_old = old_lp[rows, :width].to(self.device)
                mb_ref = ref_lp[rows, :width].to(self.device) if ref_lp is not None else None
            else:
                # padding rows: any finite values do, their weight and mask are zero
                mb_old = new_lp.detach()
                mb_ref = new_lp.detach() if ref_lp is not None else None
            terms = token_loss_terms(new_lp, mb_old, mb.behavior_logprobs, mb.advantages, self.loss_cfg, mb_ref)
            loss_sum = weighted_token_sum(terms["loss"], mb.loss_mask, mb.weights)
            # FSDP averages gradients over the dp ranks; scale so the result is the global weighted token mean
            (loss_sum * (self.dp_size / den_v)).backward()
            m = mb.loss_mask
            diff = (mb_old - mb.behavior_logprobs) * m
            stats["loss"] += loss_sum.item() / den_v
            stats["tokens"] += m.sum().item()
            stats["clipped"] += (terms["clipped"] * m).sum().item()
            stats["is_weight"] += (terms["is_weight"] * m).sum().item()
            stats["kl"] += (terms["kl"] * m).sum().item() if "kl" in terms else 0.0
            stats["behavior_kl"] += diff.sum().item()
            stats["max_diff"] = max(stats["max_diff"], diff.abs().max().item())
            stats["samples"] += (m.sum(-1) > 0).sum().item()
        max_norm = self.cfg.training.max_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        stats["grad_norm"] = float(norm)
        return stats

    # ---- weights out ---------------------------------------------------------

    def export_hf(self, out_dir: str, write: bool) -> None:
        export_hf(self.model, self.adapter, out_dir, self.hf_dir, write)

    # ---- Stateful (distributed checkpoint) -------------------------------------

    def state_dict(self) -> dict:
        opts = StateDictOptions()
        return {
            "model": get_model_state_dict(self.model, options=opts),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=opts),
            "num_updates": self.num_updates,
        }

    def init_optimizer_state(self) -> None:
        """Create AdamW's moment buffers (a step on zero gradients with lr 0), so a checkpoint can fill them."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr

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


_STAT_KEYS = ("loss", "tokens", "clipped", "is_weight", "kl", "behavior_kl", "samples")
