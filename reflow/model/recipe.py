"""Model zoo recipes: one TOML file per model in the top-level ``models/`` folder.

A recipe names the torchtitan Qwen3 flavor (or ``custom`` with an explicit
architecture), where the Hugging Face checkpoint and tokenizer live, the
recommended parallelism and the vLLM settings. ``load_recipe`` validates it;
``reflow.train --dry-run`` additionally builds the model on the meta device and
checks the architecture and parameter count.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from reflow.config.manager import read_toml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS_DIR = os.path.join(REPO_ROOT, "models")


@dataclass
class Architecture:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool


@dataclass
class Parallelism:
    gpus_per_node: int
    min_world_size: int
    trainer_shard_degree: int
    rollout_tensor_parallel_degree: int
    gpu_memory_gib: float = 80.0
    """Memory of one GPU the recipe is planned for (``reflow.memory_plan``; placement.gpu_memory_gib overrides)."""


@dataclass
class VllmSettings:
    dtype: str
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float


@dataclass
class Recipe:
    name: str
    description: str
    flavor: str
    """torchtitan qwen3 flavor ('4B', '8B', ...) or 'custom' (architecture below)."""
    hf_checkpoint: str
    hf_repo: str
    num_params: int
    device: str
    architecture: Architecture
    parallelism: Parallelism
    vllm: VllmSettings
    path: str = ""
    extra: dict = field(default_factory=dict)


def _section(data: dict, name: str, cls: type, path: str):
    if name not in data:
        raise ValueError(f"{path}: missing section [{name}]")
    table = data[name]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    optional = {f.name for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    missing = sorted(n for n in names if n not in table and n not in optional | {"architecture", "parallelism", "vllm"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) in [{name}]: {', '.join(unknown)}")
    if missing:
        raise ValueError(f"{path}: missing key(s) in [{name}]: {', '.join(missing)}")
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in table.items():
        want = hints[key]
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
        }.get(want if isinstance(want, str) else want.__name__, True)
        if not ok:
            raise ValueError(f"{path}: [{name}] {key} must be {want}, got {value!r}")
    return table


def recipe_path(name_or_path: str) -> str:
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        return name_or_path
    return os.path.join(MODELS_DIR, f"{name_or_path}.toml")


def load_recipe(name_or_path: str) -> Recipe:
    """Load ``models/<name>.toml`` (or a path); errors name the file and the key."""
    path = recipe_path(name_or_path)
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(MODELS_DIR) if f.endswith(".toml")) if os.path.isdir(MODELS_DIR) else []
        raise ValueError(f"model.recipe: no recipe file {path} (known recipes: {', '.join(known)})")
    data = read_toml(path)
    unknown = sorted(set(data) - {"recipe", "architecture", "parallelism", "vllm"})
    if unknown:
        raise ValueError(f"{path}: unknown section(s): {', '.join(unknown)}")
    top = _section(data, "recipe", Recipe, path)
    arch = Architecture(**_section(data, "architecture", Architecture, path))
    par = Parallelism(**_section(data, "parallelism", Parallelism, path))
    vll = VllmSettings(**_section(data, "vllm", VllmSettings, path))
    if arch.n_heads % arch.n_kv_heads:
        raise ValueError(f"{path}: [architecture] n_heads ({arch.n_heads}) must be a multiple of n_kv_heads ({arch.n_kv_heads})")
    if arch.n_kv_heads % par.rollout_tensor_parallel_degree and par.rollout_tensor_parallel_degree % arch.n_kv_heads:
        raise ValueError(
            f"{path}: [parallelism] rollout_tensor_parallel_degree ({par.rollout_tensor_parallel_degree}) "
            f"must divide or be a multiple of n_kv_heads ({arch.n_kv_heads})"
        )
    if top["device"] not in ("cpu", "cuda"):
        raise ValueError(f"{path}: [recipe] device must be 'cpu' or 'cuda', got {top['device']!r}")
    return Recipe(architecture=arch, parallelism=par, vllm=vll, path=path, **top)


def resolve_path(path: str) -> str:
    """Relative checkpoint paths in recipes are relative to the repository root."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = os.path.join(REPO_ROOT, path)
    return candidate if os.path.exists(candidate) else path
