import torch

from reflow.trainer.batch import pack, zero_batch


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
