"""LoRA on the policy (``reflow.trainer.lora``), 2 ranks, the tiny model in LoRA's shipped shape (every
projection adapted, activation checkpointing, a KL reference): see ``scripts/lora.py`` for each check."""

import json

from tests.conftest import run_torchrun

PROJECTIONS_PER_LAYER = 7  # q, k, v, o, gate, up, down
TINY_LAYERS = 4


def test_lora_starts_as_the_base_trains_only_adapters_and_exports_merged(tmp_path):
    out = tmp_path / "lora.json"
    run_torchrun(2, ["tests/trainer/scripts/lora.py", str(out)])
    rep = json.loads(out.read_text())
    adapters = PROJECTIONS_PER_LAYER * TINY_LAYERS
    assert rep["adapted_modules"] == adapters
    assert rep["init_logprobs_bitwise"]  # B = 0: the adapted model is the base model, exactly
    assert rep["trainable"] == ["lora_a", "lora_b"] and rep["trainable_count"] == 2 * adapters
    assert rep["changed"] == ["lora_a", "lora_b"] and rep["logprobs_moved"]
    assert rep["grads_on_frozen"] == 0 and rep["optimizer_states"] == 2 * adapters  # nothing for the base
    # the export is W + (alpha / r) B A (float32 rounding of the product), and not the base
    assert rep["export_merged_max_diff"] < 1e-6 < rep["export_differs_from_base"]
    assert not rep["export_has_adapter_tensors"]
    assert rep["resume_bitwise"] and rep["resume_logprobs_bitwise"]
    assert rep["after_resize_base_unchanged"] and rep["after_resize_optimizer_states"] == 2 * adapters
