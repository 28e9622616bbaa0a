"""The policy model: torchtitan's Qwen3, built from a recipe.

``build_model_config`` turns a recipe into a torchtitan ``Qwen3Model.Config``
(the registry flavor for paper-scale models, an explicit config for ``custom``),
with the trainer attention swapped for one that has a CPU backward when asked.
The model itself contains no parallelism: see ``reflow.trainer.parallelize``.
"""

from __future__ import annotations

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


def build_model_config(recipe: Recipe, attention: str = "sdpa"):
    """torchtitan ``Qwen3Model.Config`` for a recipe."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import qwen3_configs
    from torchtitan.models.qwen3 import _build_qwen3_layers, _qwen3_norm, _EMBEDDING_INIT, _LINEAR_INIT
    from torchtitan.models.qwen3.model import Qwen3Model

    a = recipe.architecture
    if recipe.flavor == "custom":
        cfg = Qwen3Model.Config(
            vocab_size=a.vocab_size,
            dim=a.dim,
            norm=_qwen3_norm(a.dim),
            enable_weight_tying=a.tie_embeddings,
            # untied tiny models need a real embedding init (a skipped init gives NaN losses)
            tok_embeddings=Embedding.Config(num_embeddings=a.vocab_size, embedding_dim=a.dim, param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=a.dim, out_features=a.vocab_size, param_init=_LINEAR_INIT),
            layers=_build_qwen3_layers(
                fuse_qkv=False,
                n_layers=a.n_layers,
                dim=a.dim,
                n_heads=a.n_heads,
                n_kv_heads=a.n_kv_heads,
                head_dim=a.head_dim,
                hidden_dim=a.hidden_dim,
                attn_backend="flex",
                rope=CosSinRoPE.Config(dim=a.head_dim, max_seq_len=a.max_seq_len, theta=a.rope_theta),
            ),
        )
    else:
        if recipe.flavor not in qwen3_configs:
            raise ValueError(
                f"{recipe.path}: [recipe] flavor {recipe.flavor!r} is not a torchtitan qwen3 flavor "
                f"(known: {', '.join(qwen3_configs)}, or 'custom')"
            )
        cfg = qwen3_configs[recipe.flavor](attn_backend="flex")
    for layer in cfg.layers:
        layer.attention.inner_attention = _attention_config(attention)
    return cfg


def check_architecture(recipe: Recipe, cfg) -> list[str]:
    """Differences between the recipe's [architecture] and the built torchtitan config."""
    a = recipe.architecture
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
    return [f"{k}: recipe {getattr(a, k)!r} != torchtitan {v!r}" for k, v in built.items() if getattr(a, k) != v]


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
