"""The policy model: torchtitan's Qwen3, built from a recipe.

``build_model_config`` turns a recipe into a torchtitan ``Qwen3Model.Config``
(the registry flavor for paper-scale models, with q/k/v unfused; an explicit config for ``custom``),
with the trainer attention swapped for one that has a CPU backward when asked.
The model itself contains no parallelism: see ``reflow.trainer.parallelize``.
"""

from __future__ import annotations

from functools import partial

import torch

from reflow.model.recipe import Recipe


def _attention_config(attention: str):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    if attention == "sdpa":
        # causal SDPA over right-padded single-sequence rows: correct, and it has a CPU backward
        return ScaledDotProductAttention.Config()
    if attention == "flex":
        return FlexAttention.Config()
    raise ValueError(f"model.attention: unknown attention {attention!r} (use 'sdpa' or 'flex')")


def _normal_init() -> dict:
    """Qwen3's initialization for a linear or embedding weight: normal, std 0.02; zero biases."""
    return {"weight": partial(torch.nn.init.normal_, std=0.02), "bias": torch.nn.init.zeros_}


def _rms_norm(dim: int):
    from torchtitan.models.common.nn_modules import RMSNorm

    return RMSNorm.Config(normalized_shape=dim, eps=1e-6, param_init={"weight": torch.nn.init.ones_})


def _custom_config(recipe: Recipe):
    """A dense Qwen3 of the recipe's [architecture], from torchtitan's public config builders: per layer the
    pre-norms, grouped-query attention with separate q/k/v projections and a per-head RMSNorm on q and k, and
    the SwiGLU feed-forward."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model import Qwen3TransformerBlock

    arch = recipe.architecture
    rope = CosSinRoPE.Config(dim=arch.head_dim, max_seq_len=arch.max_seq_len, theta=arch.rope_theta)
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=_rms_norm(arch.dim),
            ffn_norm=_rms_norm(arch.dim),
            attention=make_gqa_config(
                dim=arch.dim, n_heads=arch.n_heads, n_kv_heads=arch.n_kv_heads, head_dim=arch.head_dim,
                wqkv_param_init=_normal_init(), wo_param_init=_normal_init(),
                inner_attention=_attention_config("sdpa"),  # replaced by build_model_config
                fuse_qkv=False,  # vLLM's and HF's Qwen3 keep q, k and v apart: the weight sync maps 1:1
                rope=rope, qk_norm=_rms_norm(arch.head_dim),
            ),
            feed_forward=make_ffn_config(
                dim=arch.dim, hidden_dim=arch.hidden_dim, w1_param_init=_normal_init(), w2w3_param_init=_normal_init()
            ),
        )
        for _ in range(arch.n_layers)
    ]
    return Qwen3Model.Config(
        vocab_size=arch.vocab_size,
        dim=arch.dim,
        norm=_rms_norm(arch.dim),
        enable_weight_tying=arch.tie_embeddings,
        # untied tiny models need a real embedding init (a skipped init gives NaN losses)
        tok_embeddings=Embedding.Config(num_embeddings=arch.vocab_size, embedding_dim=arch.dim, param_init=_normal_init()),
        lm_head=Linear.Config(in_features=arch.dim, out_features=arch.vocab_size, param_init=_normal_init()),
        layers=layers,
    )


def _unfused(cfg):
    """A registry flavor with q, k and v as separate projections, every other setting kept.

    torchtitan's registry flavors fuse q/k/v into one ``wqkv`` parameter and split it in state-dict hooks. Two
    things break on that layout: ``get_model_state_dict`` (checkpoints, resume) walks each hooked key
    (``...wq.weight``) back to a module that does not exist (``'FusedQKVLinear' object has no attribute 'wq'``),
    and the hooks all-gather every layer's whole ``wqkv`` inside each ``state_dict()`` call (the weight sync,
    the HF load and export: 3.4 GiB per rank for 8B, outside the memory plan). vLLM's and HF's Qwen3 keep the
    three apart, so the unfused layout also maps 1:1 onto both. The flavor passes one initializer for the
    projections (its ``wo``'s), reused here for q, k and v; the weights are loaded from the HF checkpoint anyway."""
    from torchtitan.models.common import Linear
    from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear

    for layer in cfg.layers:
        attention = layer.attention
        fused = attention.qkv_linear
        if not isinstance(fused, FusedQKVLinear.Config):
            continue
        head_dim = fused.head_dim
        init = attention.wo.param_init
        attention.qkv_linear = QKVLinear.Config(
            head_dim=head_dim,
            wq=Linear.Config(in_features=attention.dim, out_features=fused.n_heads * head_dim, param_init=init),
            wkv=Linear.Config(in_features=attention.dim, out_features=fused.n_kv_heads * head_dim, param_init=init),
        )
    return cfg


def build_model_config(recipe: Recipe, attention: str = "sdpa"):
    """torchtitan ``Qwen3Model.Config`` for a recipe: the registry flavor for paper-scale models, or
    ``_custom_config`` for ``custom``; then every layer's inner attention is ``attention``."""
    from torchtitan.models.qwen3 import qwen3_configs

    if recipe.flavor == "custom":
        cfg = _custom_config(recipe)
    else:
        if recipe.flavor not in qwen3_configs:
            raise ValueError(
                f"{recipe.path}: [recipe] flavor {recipe.flavor!r} is not a torchtitan qwen3 flavor "
                f"(known: {', '.join(qwen3_configs)}, or 'custom')"
            )
        cfg = _unfused(qwen3_configs[recipe.flavor](attn_backend="flex"))
    for layer in cfg.layers:
        layer.attention.inner_attention = _attention_config(attention)
    return cfg


def check_architecture(recipe: Recipe, cfg) -> list[str]:
    """Differences between the recipe's [architecture] and the built torchtitan config."""
    arch = recipe.architecture
    attn = cfg.layers[0].attention
    ffn = cfg.layers[0].feed_forward
    built = {
        "vocab_size": cfg.vocab_size,
        "dim": cfg.dim,
        "n_layers": len(cfg.layers),
        "n_heads": attn.n_heads,
        "n_kv_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "hidden_dim": ffn.w1.out_features if ffn is not None else None,
        "rope_theta": float(attn.rope.theta),
        "tie_embeddings": bool(cfg.enable_weight_tying),
    }
    return [f"{key}: recipe {getattr(arch, key)!r} != torchtitan {value!r}"
            for key, value in built.items() if getattr(arch, key) != value]


def build_on_meta(cfg) -> torch.nn.Module:
    with torch.device("meta"):
        return cfg.build()


def init_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Materialize the derived buffers (the RoPE cache) of a model built on meta and moved with ``to_empty``,
    without initializing any parameter: the caller loads every parameter from a checkpoint or a transfer.

    Not torchtitan's ``init_states``: on CUDA its first DTensor random op creates DTensor's RNG tracker,
    which broadcasts over the whole world, so building a trainer on a subset of ranks would hang."""
    if getattr(model, "enable_weight_tying", False):
        model.tok_embeddings.weight = model.lm_head.weight  # as init_states does: re-tie after meta/to_empty
    for module in model.modules():
        init_self = getattr(module, "_init_self_buffers", None)  # torchtitan's per-module buffer hook
        if init_self is not None:
            init_self(buffer_device=device)


def count_params(model: torch.nn.Module) -> int:
    seen = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
