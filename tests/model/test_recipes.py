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
