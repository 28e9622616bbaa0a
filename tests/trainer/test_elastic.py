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
    # who holds a shard after each phase (the comparisons above skip ranks without one)
    phases = lambda events: [e["active_ranks"] for e in events if "active_ranks" in e]  # noqa: E731
    moves = lambda events: [e for e in events if "direction" in e]  # noqa: E731
    assert phases(rep["shrink_transitions"]) == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    assert phases(rep["grow_transitions"]) == [[0, 1], [0, 1], [0, 1, 2, 3]]
    shrink, grow = moves(rep["shrink_transitions"]), moves(rep["grow_transitions"])
    assert [t["direction"] for t in shrink] == ["trainer->rollout", "rollout->trainer"]
    assert shrink[0]["bytes_moved"] == 0 and shrink[0]["bytes_freed"] > 0  # leaving ranks free their shards
    assert shrink[1]["bytes_moved"] > 0
    assert grow[0]["bytes_moved"] == shrink[1]["bytes_moved"]  # both fill 2 joining ranks with half a replica each
    assert all(t["copied_not_aliased"] == 0 for t in shrink + grow)  # staying ranks adopted their shards, no copy
    assert 3 * shrink[1]["broadcasts"] < shrink[1]["tensors"]  # bucketized: a few flat broadcasts, not one per tensor


def test_resize_keeps_a_tied_lm_head_tied_and_bitwise_equal(tmp_path):
    """Qwen3 0.6B-4B tie the LM head to the embedding: the two names stay one parameter through every resize
    (the script asserts it on every rank), and training stays bitwise equal to a fixed placement."""
    out = tmp_path / "report.json"
    run_torchrun(4, ["tests/trainer/scripts/elastic_resize.py", str(out), "tied"])
    rep = json.loads(out.read_text())
    assert rep["moved"][1] > 1e-4
    assert all(equal for equal, _ in rep["shrink_equal"]), rep["shrink_equal"]
    assert rep["grow_equal_final"][0], rep["grow_equal_final"]
    hf_config = json.loads((tmp_path / "tiny-qwen3-tied" / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] is True
