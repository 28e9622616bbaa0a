"""HF <-> torchtitan: names and values survive the adapter both ways, and both models agree."""

import os

import pytest
import torch
from safetensors.torch import load_file

from reflow.model.qwen3 import build_model_config
from reflow.model.recipe import load_recipe
from reflow.trainer.hf_io import build_adapter
from tests.conftest import TINY_HF


def _tt_model():
    recipe = load_recipe("tiny")
    cfg = build_model_config(recipe, "sdpa")
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return cfg, model


def test_round_trip_is_exact():
    cfg, model = _tt_model()
    adapter = build_adapter(cfg, TINY_HF)
    hf = load_file(os.path.join(TINY_HF, "model.safetensors"))
    tt = adapter.from_hf(dict(hf))
    missing, unexpected = model.load_state_dict(tt, strict=False)
    assert not unexpected and all("rope" in m or "freqs" in m for m in missing)
    back = adapter.to_hf(model.state_dict())
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_logits_match_transformers():
    transformers = pytest.importorskip("transformers")
    cfg, model = _tt_model()
    adapter = build_adapter(cfg, TINY_HF)
    hf = load_file(os.path.join(TINY_HF, "model.safetensors"))
    model.load_state_dict(adapter.from_hf(dict(hf)), strict=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(TINY_HF, dtype=torch.float32)
    ref.eval()
    model.eval()
    tokens = torch.tensor([[1, 20, 14, 22, 14, 21, 32, 27, 12, 25]])
    with torch.no_grad():
        ours = model(tokens)
        theirs = ref(input_ids=tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_init_buffers_builds_the_rope_cache_without_touching_parameters():
    """The trainer's build path (meta -> to_empty -> init_buffers -> load) gives the same buffers as
    torchtitan's init_states, draws no random numbers (no DTensor RNG tracker on CUDA) and leaves the
    parameters for the checkpoint to fill."""
    from reflow.model.qwen3 import build_on_meta, init_buffers

    cfg, reference = _tt_model()
    model = build_on_meta(cfg)
    model.to_empty(device=torch.device("cpu"))
    state = torch.random.get_rng_state()
    init_buffers(model, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), state)
    buffers = dict(reference.named_buffers())
    assert buffers and all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
