"""LoRA on the policy (``reflow.trainer.lora``), 2 ranks, the tiny model in LoRA's shipped shape (every
projection adapted, activation checkpointing, a KL reference): see ``scripts/lora.py`` for each check."""

import json
import os

import torch

from tests.conftest import ROOT, run_torchrun

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
    assert rep["start_from_folder_bitwise"]  # lora.adapter: the exported folder back in, exactly
    assert rep["after_resize_base_unchanged"] and rep["after_resize_optimizer_states"] == 2 * adapters
    # growing back: the rejoining rank moved only the adapters and their AdamW state (moments, steps) and the
    # update count; its base came from the checkpoint; both replicas hold the same shards
    grow = rep["grow"]
    assert all(part["bitwise_equal"] for part in grow)
    joined = grow[1]
    assert joined["bytes_moved"] < 4 * joined["trained_bytes"] < joined["model_bytes"]
    # bf16 gathers: the frozen base is kept in bf16 (half its bytes) and changes nothing the forward sees
    assert rep["bf16_frozen_dtypes"] == ["torch.bfloat16"] and rep["bf16_trained_dtypes"] == ["torch.float32"]
    assert rep["bf16_init_logprobs_bitwise"] and rep["bf16_trains"]
    # the peft folder, loaded by peft onto the base checkpoint, gives the trainer's log-probs
    assert rep["adapter_modules"] == adapters
    trained = torch.tensor(rep["trainer_logprobs"])
    peft_logprobs = _peft_logprobs(str(tmp_path / "adapter"), rep["peft_probe_tokens"])
    assert torch.allclose(peft_logprobs, trained, atol=PEFT_ATOL), (peft_logprobs - trained).abs().max()
    # (and the adapters matter: without them the base is far off, 1.1 measured)
    base_logprobs = _peft_logprobs(None, rep["peft_probe_tokens"])
    assert (base_logprobs - trained).abs().max() > 100 * PEFT_ATOL


# float32 on both sides, different kernels (the trainer's chunked log-softmax, transformers' eager attention):
# measured difference 4.8e-7; a wrong adapter (a transposed or unscaled B A) is off by 1e-2 and more
PEFT_ATOL = 1e-4


def _peft_logprobs(adapter_dir: str | None, tokens: list[int]) -> torch.Tensor:
    """Each token's log-prob after the ones before it, under the base checkpoint with ``adapter_dir`` loaded by
    peft (None: the base alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-qwen3"), torch_dtype=torch.float32)
    model = (PeftModel.from_pretrained(base, adapter_dir) if adapter_dir else base).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]

