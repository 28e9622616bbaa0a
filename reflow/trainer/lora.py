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

import json
import math
import os
import zlib
from dataclasses import dataclass
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


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Keep ``model``'s frozen parameters (a LoRA run's base) in ``dtype``, the dtype FSDP2 gathers them in
    (``training.param_dtype``): their values reach the forward exactly as before, at half the resident bytes
    for bf16, with no gradient or optimizer state to keep in float32. On meta, before FSDP2 (which needs one
    dtype across the trained parameters only). Returns how many parameters changed dtype."""
    changed = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.requires_grad and param.dtype != dtype:
                setattr(module, name, nn.Parameter(param.detach().to(dtype), requires_grad=False))
                changed += 1
    return changed


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


PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


@dataclass
class AdapterPlan:
    tensors: list[tuple[str, str, tuple[int, ...]]]
    """(torchtitan key, peft name, shape) of every adapter tensor, in order."""
    config: dict
    """The peft ``adapter_config.json`` of every version."""
    dtype: torch.dtype
    """The engine's: what the adapters are sent and stored in."""

    @property
    def numel(self) -> int:
        return sum(torch.Size(shape).numel() for _, _, shape in self.tensors)


def build_adapter_plan(model_config, adapter, lora, hf_dir: str, dtype: torch.dtype = torch.float32) -> AdapterPlan:
    """This model's adapters in peft's layout (the sync's, the export's and a starting folder's), from the
    model config on the meta device."""
    from reflow.model.qwen3 import build_on_meta

    meta = build_on_meta(model_config)
    apply_lora(meta, lora, model_projections(adapter))
    state = meta.state_dict()
    tensors = []
    for weight, (a_key, b_key) in adapters_of(state, state).items():
        (hf_weight,) = adapter.to_hf({weight: state[weight]}).keys()
        module = "base_model.model." + hf_weight[: -len(".weight")]
        tensors.append((a_key, f"{module}.lora_A.weight", tuple(state[a_key].shape)))
        tensors.append((b_key, f"{module}.lora_B.weight", tuple(state[b_key].shape)))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(lora.target_modules), "bias": "none",
        "base_model_name_or_path": os.path.abspath(hf_dir), "fan_in_fan_out": False, "inference_mode": True,
    }
    return AdapterPlan(tensors, config, dtype)


def check_adapter_folder(folder: str, plan: AdapterPlan, lora, key: str = "lora.adapter") -> None:
    """A peft adapter folder this run can start from: a ValueError naming ``key`` and the file otherwise (its
    config's rank, alpha and targets against [lora]'s, its tensors' names and shapes against the model's; only
    the safetensors header is read)."""
    config_path, weights = os.path.join(folder, PEFT_CONFIG), os.path.join(folder, PEFT_WEIGHTS)
    if not os.path.isfile(config_path) or not os.path.isfile(weights):
        raise ValueError(f"{key}: {folder} is not a peft adapter folder (it needs {PEFT_CONFIG} and {PEFT_WEIGHTS})")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{key}: {config_path} is not readable JSON ({error})") from None
    wanted = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha}
    for field, value in wanted.items():
        if config.get(field) != value and not (isinstance(value, float) and config.get(field) == int(value)):
            raise ValueError(f"{key}: {config_path} has {field} = {config.get(field)!r}, this run's [lora] {value!r}")
    targets = config.get("target_modules")
    if sorted(targets or []) != sorted(lora.target_modules):
        raise ValueError(f"{key}: {config_path} adapts {targets}, this run's lora.target_modules "
                         f"{sorted(lora.target_modules)}")
    try:
        with open(weights, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        assert isinstance(header, dict)
    except (OSError, ValueError, AssertionError, MemoryError):
        raise ValueError(f"{key}: {weights} is not a readable safetensors file") from None
    have = {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    expected = {name: shape for _, name, shape in plan.tensors}
    missing, extra = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
    if missing or extra:
        raise ValueError(f"{key}: {weights} does not match this model's adapters (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}): an adapter of another base model?")
    wrong = [name for name in expected if have[name] != expected[name]]
    if wrong:
        raise ValueError(f"{key}: {weights}: {wrong[0]} has shape {list(have[wrong[0]])}, this model's is "
                         f"{list(expected[wrong[0]])}: an adapter of another base model?")


@torch.no_grad()
def load_adapter_folder(model: torch.nn.Module, folder: str, plan: AdapterPlan) -> None:
    """Fill ``model``'s (sharded) adapters from a peft folder checked by ``check_adapter_folder``: every rank
    reads the file and keeps its shards (no collective)."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    tensors = load_file(os.path.join(folder, PEFT_WEIGHTS))
    params = dict(model.named_parameters())
    for key, name, _ in plan.tensors:
        param = next(p for n, p in params.items() if n.replace("_checkpoint_wrapped_module.", "") == key)
        value = tensors[name].to(param.device, param.dtype)
        if isinstance(param, DTensor):
            value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(value)
        else:
            param.copy_(value)

