"""Trainer state parked in host memory while a colocated engine generates comes back bitwise."""

import json

from tests.conftest import run_torchrun


def test_parked_state_frees_the_device_bytes_and_trains_bitwise_as_before(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(2, ["tests/trainer/scripts/park_state.py", str(out)])
    rep = json.loads(out.read_text())
    assert rep["bitwise_equal"]
    assert rep["restored"] == [True, True, True]
    for moved, all_freed in rep["freed"]:
        assert all_freed
        # parameters, both AdamW moments and the reference: at least every shard's bytes (FSDP pads a shard
        # whose dim 0 does not divide by 2, and the padded storage moves whole)
        assert moved >= rep["shard_bytes"], (moved, rep["shard_bytes"])

    # the host buffers are allocated at the first parking, at the parked bytes exactly, and reused every step
    assert rep["same_buffers"]
    assert rep["host_bytes"] == [moved for moved, _ in rep["freed"]]
