"""A torchtitan registry flavor (the GPU recipes' model class), built as the recipes build it and sharded with
FSDP2, checkpoints and loads exactly (``scripts/registry_flavor_checkpoint.py``, torchtitan's small
``debugmodel`` flavor, which fuses q/k/v as the 4B-32B flavors do). Before the recipes built these flavors
unfused, the checkpoint's ``get_model_state_dict`` failed at once."""

import json

from tests.conftest import run_torchrun


def test_a_registry_flavor_checkpoints_and_loads_exactly(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(1, ["tests/model/scripts/registry_flavor_checkpoint.py", str(tmp_path / "ckpt"), str(out)])
    report = json.loads(out.read_text())
    assert report["qkv_modules"] == ["QKVLinear"]  # not FusedQKVLinear
    assert {k.rsplit(".", 2)[-2] for k in report["layer0_keys"]} >= {"wq", "wk", "wv", "wo"}
    assert report["keys_match_meta"] and report["state_keys"] > 0
    assert report["differ_after_load"] == [] and report["same_logits"]
