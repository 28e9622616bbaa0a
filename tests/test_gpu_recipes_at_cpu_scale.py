"""The shipped GPU recipes' own code paths on CPU ranks (``reflow.config.cpu_scale``: the tiny model and CPU-sized
lengths, batches and world; the recipe's mode, placement shape, algorithm, replay, weight-sync interval,
scheduler, activation checkpointing, bf16 gathers and checkpointing kept). Every GPU config gets overrides that
validate on 4 ranks; the two shapes the recipes come in run: decoupled HSDP with 2 replicas and 2 rollout ranks
(DAPO: dynamic sampling, clip-higher, overlong shaping, 4 minibatches) through a checkpoint every step, a resume,
and an HF export that transformers loads; and colocated sync mode (qwen3_8b) through a checkpoint and the export."""

import glob
import json
import os

import pytest
import torch

from reflow.config import ConfigManager
from reflow.config.cpu_scale import cpu_scale_overrides
from reflow.config.validate import validate, validate_world
from reflow.model.recipe import load_recipe
from tests.conftest import ROOT, run_torchrun

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


def test_the_dapo_recipe_at_cpu_scale_checkpoints_resumes_and_exports(tmp_path):
    config = "train_configs/dapo_qwen3_8b_math.toml"
    dump = str(tmp_path / "run")
    common = ["-m", "reflow.train", "--config", config, *_overrides(config, 4), f"--job.dump_folder={dump}"]
    run_torchrun(4, common)
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2] and all(r["mode"] == "reflow" for r in rows)
    assert all(r["weight_sync_s"] > 0 for r in rows)  # weight_sync.interval = 1: a sync after every step
    assert os.path.exists(os.path.join(dump, "checkpoint", "step-2", ".metadata"))
    proc = run_torchrun(4, common + ["--training.steps=3"])
    assert "resumed from step 2" in proc.stderr
    assert [r["step"] for r in _rows(dump)] == [1, 2, 3]
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(dump, "hf_final"), dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()


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
