import glob
import os

import pytest

from reflow.model.qwen3 import build_model_config, build_on_meta, check_architecture, count_params
from reflow.model.recipe import MODELS_DIR, load_recipe

RECIPES = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(MODELS_DIR, "*.toml")))


def test_zoo_has_the_paper_models():
    assert {"tiny", "qwen3_4b", "qwen3_8b", "qwen3_14b", "qwen3_32b"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_matches_torchtitan(name):
    r = load_recipe(name)
    cfg = build_model_config(r)
    assert check_architecture(r, cfg) == []
    assert count_params(build_on_meta(cfg)) == r.num_params


def test_recipe_errors_name_file_and_key(tmp_path):
    src = open(os.path.join(MODELS_DIR, "tiny.toml")).read()
    bad = tmp_path / "bad.toml"
    bad.write_text(src.replace("n_kv_heads = 2", "n_kv_heads = 2\nn_experts = 4"))
    with pytest.raises(ValueError, match=r"bad.toml.*unknown key.*n_experts"):
        load_recipe(str(bad))
    bad.write_text(src.replace("head_dim = 32\n", ""))
    with pytest.raises(ValueError, match=r"missing key.*head_dim"):
        load_recipe(str(bad))
    bad.write_text(src.replace("n_heads = 4", "n_heads = 3"))
    with pytest.raises(ValueError, match="n_kv_heads"):
        load_recipe(str(bad))
    with pytest.raises(ValueError, match="model.recipe"):
        load_recipe("qwen3_999b")


def test_unknown_flavor(tmp_path):
    src = open(os.path.join(MODELS_DIR, "qwen3_8b.toml")).read()
    bad = tmp_path / "bad.toml"
    bad.write_text(src.replace('flavor = "8B"', 'flavor = "9B"'))
    with pytest.raises(ValueError, match="flavor"):
        build_model_config(load_recipe(str(bad)))


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_builds_q_k_v_apart_and_maps_one_to_one_onto_hf(name):
    """torchtitan's registry flavors fuse q/k/v into one ``wqkv`` whose state-dict hooks break
    ``get_model_state_dict`` (every GPU recipe's first checkpoint) and all-gather the fused weight in each
    ``state_dict()``; the recipes build them unfused. Every parameter name then maps to exactly one HF name,
    the q/k/v projections each to their own, as vLLM and HF keep them (on meta: no memory)."""
    from torchtitan.models.common.attention import FusedQKVLinear

    from reflow.trainer.hf_io import build_adapter

    cfg = build_model_config(load_recipe(name))
    model = build_on_meta(cfg)
    assert not any(isinstance(module, FusedQKVLinear) for module in model.modules())
    names = [key for key in model.state_dict() if "rope" not in key and "freqs" not in key]
    # no hook renames a key: the state dict's names are the parameters' own (tied ones under both names)
    assert names == [key for key, _ in model.named_parameters(remove_duplicate=False)]
    hf = build_adapter(cfg, None).to_hf({key: model.state_dict()[key] for key in names})
    for layer in range(len(cfg.layers)):
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert f"model.layers.{layer}.self_attn.{projection}.weight" in hf, sorted(hf)[:12]
