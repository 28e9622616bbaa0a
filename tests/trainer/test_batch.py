import pytest
import torch

from reflow.trainer.batch import pack, plan_micro_batches, zero_batch


def test_pack_aligns_to_targets():
    b = pack(
        prompts=[[1, 10, 11], [1, 12]],
        completions=[[20, 2], [21, 22, 2]],
        behavior_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]],
        versions=[[3, 3], [4, 4, 5]],
        advantages=[1.0, -1.0],
        weights=[1.0, 0.5],
        rewards=[1.0, 0.0],
        pad_id=0,
    )
    assert b.tokens.tolist() == [[1, 10, 11, 20, 2], [1, 12, 21, 22, 2]]
    # target column t predicts token t+1: completion of row 0 starts at token 3 -> column 2
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert torch.allclose(b.behavior_logprobs[0], torch.tensor([0, 0, -0.1, -0.2]))
    assert b.versions.tolist() == [[-1, -1, 3, 3], [-1, 4, 4, 5]]
    assert b.num_tokens() == 5


def test_zero_batch_contributes_nothing():
    z = zero_batch(None)
    assert z.size == 1 and z.loss_mask.sum() == 0 and z.weights.sum() == 0


def test_micro_batches_without_a_token_budget_are_row_counts_shortest_first():
    lengths = [9, 3, 7, 3, 12]
    assert plan_micro_batches(lengths, 2) == [[1, 3], [2, 0], [4]]  # stable: rows 1 and 3 tie
    assert plan_micro_batches(lengths, 8) == [[1, 3, 2, 0, 4]]


def test_a_token_budget_pads_a_straggler_alone_and_packs_short_rows():
    # a long-tail batch: one row of 100 tokens, three of 30, twelve of 10
    lengths = [10] * 6 + [100] + [30] * 3 + [10] * 6
    plan = plan_micro_batches(lengths, 16, 120)
    # longest first: the straggler alone, the 30s with the longest 10 that fits, the other 10s together
    assert plan == [[6], [15, 7, 8, 9], list(range(0, 6)) + list(range(10, 15))]
    padded = sum(len(rows) * max(lengths[i] for i in rows) for rows in plan)
    assert padded == 100 + 120 + 110  # against 16 x 100 in one pass
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))  # every row, once
    for rows in plan:
        assert len(rows) <= 16 and (len(rows) == 1 or len(rows) * max(lengths[i] for i in rows) <= 120)


def test_a_token_budget_keeps_the_row_cap_and_a_row_longer_than_the_budget_runs_alone():
    assert plan_micro_batches([5] * 7, 3, 1000) == [[4, 5, 6], [1, 2, 3], [0]]
    assert plan_micro_batches([300, 2, 2], 4, 256) == [[0], [1, 2]]
    assert plan_micro_batches([], 4, 256) == []
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches([3], 0, 10)
