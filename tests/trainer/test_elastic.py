"""Resizing the trainer's replica dimension (2x2 <-> 1x2 on 4 ranks) leaves the training bitwise unchanged."""

import json

from tests.conftest import run_torchrun


def test_resize_is_bitwise_equal_to_a_fixed_placement(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(4, ["tests/trainer/scripts/elastic_resize.py", str(out)])
    rep = json.loads(out.read_text())
    assert rep["moved"][0] is False and rep["moved"][1] > 1e-4  # training moved the weights
    # shrink 2x2 -> 1x2 -> 2x2: parameters, AdamW moments and steps, and the reference, bitwise, after every phase
    assert all(equal for equal, _ in rep["shrink_equal"]), rep["shrink_equal"]
    # grow 1x2 -> 2x2 onto ranks that never trained
    assert rep["grow_equal_final"][0], rep["grow_equal_final"]
    # two micro-batches per virtual rank associate the gradient sums differently: only ulps apart
    assert rep["fine_vs_fixed"][1] < 1e-5, rep["fine_vs_fixed"]
    shrink, grow = rep["shrink_transitions"], rep["grow_transitions"]
    assert [t["direction"] for t in shrink] == ["trainer->rollout", "rollout->trainer"]
    assert shrink[0]["bytes_moved"] == 0 and shrink[1]["bytes_moved"] > 0
    assert grow[0]["bytes_moved"] == shrink[1]["bytes_moved"]  # both fill 2 joining ranks with half a replica each
    assert 3 * shrink[1]["broadcasts"] < shrink[1]["tensors"]  # bucketized: a few flat broadcasts, not one per tensor
