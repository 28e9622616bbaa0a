"""The shipped GPU recipes' own code paths on CPU ranks (``reflow.config.cpu_scale``: the tiny model and CPU-sized
lengths, batches and world; the recipe's mode, placement shape, algorithm, replay, weight-sync interval,
scheduler, activation checkpointing, bf16 gathers and checkpointing kept). Every GPU config gets overrides that
validate on 4 ranks; the two shapes the recipes come in run: decoupled HSDP with 2 replicas and 2 rollout ranks
(the paper's math recipe) on a torchtitan registry flavor with fused q/k/v, the GPU recipes' model class, through
a checkpoint every step, a resume, a weight sync every step and an HF export that transformers loads; and
colocated sync mode (qwen3_8b) through a checkpoint and the export."""

import glob
import json
import os

import pytest
import torch

from reflow.config import ConfigManager
from reflow.config.cpu_scale import cpu_scale_overrides
from reflow.config.validate import validate, validate_world
from reflow.model.recipe import load_recipe
from tests.conftest import ROOT, TINY_HF, run_torchrun

GPU_CONFIGS = sorted(
    os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "train_configs", "*.toml"))
    if load_recipe(ConfigManager().parse_args(["--config", path]).model.recipe).device == "cuda"
)


def _overrides(config: str, world: int) -> list[str]:
    return cpu_scale_overrides(ConfigManager().parse_args(["--config", os.path.join(ROOT, config)]), world)


def _rows(dump: str) -> list[dict]:
    """The step rows (the placement planner writes rows of its own)."""
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "mode" in row]


def test_every_gpu_recipe_has_cpu_scale_overrides_that_validate():
    assert len(GPU_CONFIGS) >= 10
    for config in GPU_CONFIGS:
        manager = ConfigManager()
        cfg = manager.parse_args(["--config", os.path.join(ROOT, config), *_overrides(config, 4)])
        validate(cfg, manager.where)
        placement = validate_world(cfg, 4)
        original = ConfigManager().parse_args(["--config", os.path.join(ROOT, config)])
        # the shape kept: the mode, colocated or not, the replicas (as many as 4 ranks allow), the algorithm
        assert cfg.training.mode == original.training.mode, config
        assert placement.colocated == (original.placement.num_rollout_ranks == 0), config
        assert cfg.loss == original.loss and cfg.advantage == original.advantage and cfg.kl == original.kl, config
        assert cfg.replay == original.replay and cfg.scheduler == original.scheduler, config
        assert (cfg.training.activation_checkpointing, cfg.training.param_dtype) == (
            original.training.activation_checkpointing, original.training.param_dtype), config


REGISTRY_TINY = """[recipe]
name = "tiny_registry"
description = "torchtitan's debugmodel flavor: a registry flavor, q/k/v fused as in the 4B-32B flavors"
flavor = "debugmodel"
hf_checkpoint = "{hf}"
hf_repo = ""
num_params = 31987968
device = "cpu"

[architecture]
vocab_size = 2048
dim = 256
n_layers = 8
n_heads = 16
n_kv_heads = 8
head_dim = 128
hidden_dim = 3072
rope_theta = 1000000.0
max_seq_len = 4096
tie_embeddings = true

[parallelism]
gpus_per_node = 0
min_world_size = 1
trainer_shard_degree = -1
rollout_tensor_parallel_degree = 1

[vllm]
dtype = "float32"
max_model_len = 256
max_num_seqs = 128
gpu_memory_utilization = 0.0
"""


def _registry_flavor_recipe(folder) -> str:
    """A recipe of torchtitan's ``debugmodel`` registry flavor (the class the GPU recipes build, fused q/k/v and
    tied embeddings) and a Hugging Face checkpoint of its shape with random weights and the tiny tokenizer, saved
    in bf16 as Qwen's checkpoints are."""
    import shutil

    transformers = pytest.importorskip("transformers")
    hf = os.path.join(folder, "hf")
    config = json.load(open(os.path.join(TINY_HF, "config.json")))
    config.update(vocab_size=2048, hidden_size=256, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, tie_word_embeddings=True, max_position_embeddings=4096,
                  layer_types=["full_attention"] * 8)
    for key in ("architectures", "transformers_version", "dtype"):
        config.pop(key, None)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).to(torch.bfloat16).save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TINY_HF, name), hf)
    path = os.path.join(folder, "tiny_registry.toml")
    with open(path, "w") as f:
        f.write(REGISTRY_TINY.format(hf=hf))
    return path


@pytest.mark.parametrize("config", ["train_configs/paper_math_qwen3_8b.toml", "train_configs/qwen3_8b_lora.toml"],
                         ids=["paper_math", "lora"])
def test_a_decoupled_recipe_on_a_registry_flavor_checkpoints_resumes_syncs_and_exports(tmp_path, config):
    """The paper's math recipe (reflow, HSDP 2 replicas + 2 rollout ranks, bf16 gathers, full activation
    checkpointing, a sync after every step) on a torchtitan registry flavor, as the GPU recipes build theirs: the
    path that crashed at the first checkpoint before the flavors were built unfused. The HF load, FSDP2, the
    checkpoint, the resume, the weight sync into vLLM and the HF export all cross the fused layout's names. The
    weights are random, so no answer scores and the policy does not move: the export must equal the checkpoint
    it started from, bit for bit (the export is fp32, the bf16 source widened). The LoRA recipe the same way, with
    adapter syncs into vLLM (every adapter's B is still 0, and the frozen base is kept in bf16, the gather dtype:
    the merged export equals the source too; an fp32 source would come back rounded to bf16)."""
    from safetensors.torch import load_file

    recipe = _registry_flavor_recipe(str(tmp_path / "model"))
    dump = str(tmp_path / "run")
    common = ["-m", "reflow.train", "--config", config, *_overrides(config, 4), f"--model.recipe={recipe}",
              f"--job.dump_folder={dump}"]
    run_torchrun(4, common)
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2] and all(r["mode"] == "reflow" for r in rows)
    assert all(r["weight_sync_s"] > 0 for r in rows)  # weight_sync.interval = 1: a sync after every step
    assert os.path.exists(os.path.join(dump, "checkpoint", "step-2", ".metadata"))
    proc = run_torchrun(4, common + ["--training.steps=3"])
    assert "resumed from step 2" in proc.stderr
    assert [r["step"] for r in _rows(dump)] == [1, 2, 3]
    exported = load_file(os.path.join(dump, "hf_final", "model.safetensors"))
    source = load_file(os.path.join(tmp_path, "model", "hf", "model.safetensors"))
    assert source["model.norm.weight"].dtype == torch.bfloat16
    assert exported.keys() == source.keys() and all(torch.equal(exported[k], source[k].float()) for k in source)
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(dump, "hf_final"), dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()
    if "lora" in config:
        assert os.path.exists(os.path.join(dump, "adapter_final", "adapter_model.safetensors"))
        assert sum(r["rollout_held_at_sync"] for r in _rows(dump)) == 0


def test_the_sync_recipe_at_cpu_scale_checkpoints_and_exports(tmp_path):
    config = "train_configs/qwen3_8b.toml"
    dump = str(tmp_path / "run")
    run_torchrun(2, ["-m", "reflow.train", "--config", config, *_overrides(config, 2), f"--job.dump_folder={dump}"])
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2] and all(r["mode"] == "sync" for r in rows)
    assert os.path.exists(os.path.join(dump, "checkpoint", "step-2", ".metadata"))
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(dump, "hf_final"), dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()
