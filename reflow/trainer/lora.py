"""LoRA adapters on the policy's projections (``[lora]``): the base weights frozen, a low-rank update trained.

    projections = model_projections(adapter)          # {"q_proj": "attention.qkv_linear.wq", ...} of this model
    adapted = apply_lora(model, cfg.lora, projections)  # on meta, before FSDP: the targets wrapped, the rest frozen
    init_lora(model, seed)                            # after the base weights are loaded: A random, B = 0
    merged = merge(weight, a, b, scale)               # W + (alpha / r) B A: what the engine serves

Each adapted projection ``y = x W^T`` becomes ``y = x W^T + (alpha / r) (drop(x) A^T) B^T`` with ``A`` (r x in)
and ``B`` (out x r). ``B`` starts at zero, so the adapted model is the base model at step 0, exactly. The
projection keeps its ``weight`` (and ``bias``) under their own names: checkpoints of the base, the Hugging Face
mapping and the weight sync see the names they always saw; the adapter adds ``lora_a`` and ``lora_b`` beside
them. Everything else in the model is frozen (no gradient, no optimizer state) unless ``lora.train_embeddings``
or ``lora.train_head`` says otherwise.

Dropout applies only where a gradient is taken (the training forward); the log-probs a step recomputes without
one (old, reference) are the deterministic model's, as the engine's are.

Our own small module rather than ``peft``: it has to live inside torchtitan's model under FSDP2 (every parameter
a DTensor shard, frozen and trained ones in one block), keep the base's parameter names, and merge shard by
shard at a sync; ``peft`` wraps Hugging Face modules and renames their parameters. The export writes ``peft``'s
format (``reflow.export``), so ``peft`` loads what this trains.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from reflow.config.job_config import LoraSection

LORA_A, LORA_B = "lora_a", "lora_b"


def model_projections(adapter) -> dict[str, str]:
    """The model's linear projections per layer, by their Hugging Face names (``q_proj``, ..., ``down_proj``):
    each one's module path inside a layer, read from the torchtitan state-dict adapter's own map (so a
    torchtitan rename cannot leave LoRA pointing at nothing)."""
    out = {}
    for hf_key, tt_key in adapter.from_hf_map.items():
        if tt_key is None or hf_key.count("{}") != 1 or not hf_key.endswith("_proj.weight"):
            continue
        short = hf_key.split(".")[-2]
        out[short] = tt_key[len("layers.{}."):-len(".weight")]
    return out


class LoraLinear(nn.Module):
    """A linear projection with a LoRA adapter: the base's ``weight`` and ``bias`` (frozen), ``lora_a`` and
    ``lora_b`` (trained)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self.rank, self.scale, self.dropout = rank, alpha / rank, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update_input = F.dropout(x, self.dropout, training=True) if self.dropout and torch.is_grad_enabled() else x
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(update_input, self.lora_a),
                                                                           self.lora_b)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}"


def apply_lora(model: nn.Module, lora: "LoraSection", projections: dict[str, str]) -> list[str]:
    """Wrap every layer's target projections (``lora.target_modules``) with ``LoraLinear`` and freeze the rest
    of ``model`` (but the embeddings / the head, when ``lora`` trains them). Returns the adapted modules'
    paths. A ValueError names the key when a target is not one of this model's projections."""
    unknown = [name for name in lora.target_modules if name not in projections]
    if unknown:
        raise ValueError(f"lora.target_modules: {unknown} name no projection of this model (it has "
                         f"{', '.join(sorted(projections))})")
    model.requires_grad_(False)
    adapted = []
    for layer_name, layer in model.layers.items():
        for target in lora.target_modules:
            parent_path, _, attribute = projections[target].rpartition(".")
            parent = layer.get_submodule(parent_path) if parent_path else layer
            base = getattr(parent, attribute)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"lora.target_modules: {target} ({projections[target]}) is a "
                                 f"{type(base).__name__} in this model, not a linear projection")
            setattr(parent, attribute, LoraLinear(base, lora.rank, lora.alpha, lora.dropout))
            adapted.append(f"layers.{layer_name}.{projections[target]}")
    tied = getattr(model, "enable_weight_tying", False)
    if tied and lora.train_embeddings != lora.train_head:
        raise ValueError("lora.train_head / lora.train_embeddings: this model ties its head to its embeddings "
                         "(one tensor); set both or neither")
    if lora.train_embeddings:
        model.tok_embeddings.weight.requires_grad_(True)
    if lora.train_head:
        model.lm_head.weight.requires_grad_(True)
    return adapted


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Every adapted projection of ``model``, by its path (``layers.0.attention.qkv_linear.wq``)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """A random (``peft``'s default: Kaiming-uniform, a = sqrt(5)), B = 0. Each A is drawn whole from a generator
    seeded by the run's seed and the module's path, then each rank keeps its shard: the same adapter whatever
    the placement, and no collective."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, module in lora_modules(model).items():
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(module.lora_a.shape, dtype=torch.float32)
        bound = 1.0 / math.sqrt(module.in_features)  # kaiming_uniform_(a=sqrt(5)) on (r, in): 1/sqrt(fan_in)
        full.uniform_(-bound, bound, generator=generator)
        for param, value in ((module.lora_a, full), (module.lora_b, torch.zeros(module.lora_b.shape))):
            if isinstance(param, DTensor):
                local = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                                          src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(value)


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The adapted projection as one weight, in float32: W + scale * B A."""
    return weight.float() + scale * (b.float() @ a.float())


def adapters_of(state: dict, names) -> dict[str, tuple[str, str]]:
    """Of the state-dict ``names``, the adapted projections' weights, each with its adapter's two keys."""
    out = {}
    for name in names:
        if name.endswith(".weight") and (prefix := name[: -len("weight")]) + LORA_A in state:
            out[name] = (prefix + LORA_A, prefix + LORA_B)
    return out


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
