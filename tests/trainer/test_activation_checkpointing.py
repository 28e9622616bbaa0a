"""training.activation_checkpointing = 'full' recomputes blocks in the backward pass and changes nothing else."""

import json

from tests.conftest import run_torchrun


def test_activation_checkpointing_trains_bitwise_alike_through_a_resize(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(2, ["tests/trainer/scripts/activation_checkpointing.py", str(out)])
    rep = json.loads(out.read_text())
    assert rep["wrapped"] == {"none": 0, "full": 4}  # every block of the tiny model recomputes
    assert rep["same_keys"] and not rep["wrapper_in_keys"]  # checkpoints, the HF adapter and the sync see one naming
    assert rep["bitwise_equal"]
