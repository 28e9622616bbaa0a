"""What a finished LoRA run of ``train_configs/tiny_lora.toml`` must show, in any mode: checked by
``tests/test_lora_training.py`` (async, one_step_off, sync) and by the reflow learning run of
``tests/test_tiny_variants_learn.py``."""

import os

import torch
from safetensors.torch import load_file

from reflow.config import ConfigManager
from tests.conftest import ROOT

TINY_LAYERS, RANK = 4, 16
CONFIG = ConfigManager().parse_args(["--config", os.path.join(ROOT, "train_configs", "tiny_lora.toml")])
TINY = {"dim": 128, "q": 128, "kv": 64, "hidden": 384}
ADAPTER_NUMEL = TINY_LAYERS * RANK * (
    (TINY["dim"] + TINY["q"]) * 2  # q_proj, o_proj
    + (TINY["dim"] + TINY["kv"]) * 2  # k_proj, v_proj
    + (TINY["dim"] + TINY["hidden"]) * 3  # gate_proj, up_proj, down_proj
)


def check_lora_run(dump: str, rows: list[dict], mode: str) -> None:
    """A finished LoRA run of ``mode`` (its step rows) moved only adapters, held nothing at a sync, and exported
    the merged policy and a peft adapter folder."""
    if mode != "sync":
        assert sum(r["rollout_syncs"] for r in rows) >= 1  # (the workers' reports may trail the steps)
        assert sum(r["rollout_held_at_sync"] for r in rows) == 0  # nothing stopped, nothing prefilled again
        # async and one_step_off waste nothing; reflow's default window may let the b sigma latest-deadline
        # samples of a step that replayed its full share outlive delta (docs/decoupled_protocol.md), and did:
        # 16 of them at step 6 in two of three runs
        batch = CONFIG.training.prompts_per_step * CONFIG.training.group_size
        worst = batch * CONFIG.replay.sigma if mode == "reflow" else 0
        assert all(r["evicted_at_sync"] <= worst for r in rows), [r["evicted_at_sync"] for r in rows]
        assert all(r["staleness_max"] <= 1 for r in rows)
    # the merged policy, and the adapters in peft format (2 r (in + out) numbers per adapted projection: what
    # every sync moved), at the end
    merged = load_file(os.path.join(dump, "hf_final", "model.safetensors"))
    adapters = load_file(os.path.join(dump, "adapter_final", "adapter_model.safetensors"))
    assert sum(t.numel() for t in adapters.values()) == ADAPTER_NUMEL
    base = load_file(os.path.join(ROOT, "assets", "tiny-qwen3-tools", "model.safetensors"))
    moved = [k for k in merged if not torch.equal(merged[k], base[k].float())]
    assert moved and all("proj" in k for k in moved)  # only the adapted projections changed
