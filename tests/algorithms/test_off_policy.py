"""Off-policy corrections (``reflow.algorithms.off_policy``) against numbers worked out by hand, with
rho_t = exp(logp_old - logp_behavior): token_tis caps each token's rho at C, sequence_tis puts the capped
product of a sequence's rhos on every token, token_mask drops exactly the tokens whose rho leaves
[low, high] and keeps weight rho on the others, sequence_mask drops whole sequences whose product leaves the
band (weight the product inside), none is 1. Masked tokens never enter a product, huge log-ratios stay finite, the
weights are detached, and the mismatch statistics (mean log-ratio, max, K3 of KL(behavior || trainer)) are
checked by hand."""

import math

import pytest
import torch

from reflow.algorithms.off_policy import CORRECTIONS, OffPolicyCorrection, mismatch, sequence_log_rho

F64 = torch.float64


def _pair(rhos):
    """(logp_old, logp_behavior) with exp(logp_old - logp_behavior) = rhos, around log 0.3."""
    behavior = torch.full((len(rhos), len(rhos[0])), math.log(0.3), dtype=F64)
    return behavior + torch.log(torch.tensor(rhos, dtype=F64)), behavior


# rows: rho per token (3 tokens each)
#   row 0: 2.5, 1.5, 0.4     product 1.5
#   row 1: 2.0, 1.5, 1.0     product 3.0
#   row 2: 0.5, 0.5, 1.5     product 0.375
#   row 3: 2.0, 0.5, (10)    the last token masked: product 1.0
RHOS = [[2.5, 1.5, 0.4], [2.0, 1.5, 1.0], [0.5, 0.5, 1.5], [2.0, 0.5, 10.0]]
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=F64)


def test_token_tis_by_hand():
    # min(rho, 2): 2, 1.5, 0.4 | 2, 1.5, 1 | 0.5, 0.5, 1.5 | 2, 0.5, and the masked token exp(0) = 1
    old, beh = _pair(RHOS)
    corr = OffPolicyCorrection("token_tis", cap=2.0)
    w = corr.weights(old, beh, MASK)
    expect = torch.tensor([[2.0, 1.5, 0.4], [2.0, 1.5, 1.0], [0.5, 0.5, 1.5], [2.0, 0.5, 1.0]], dtype=F64)
    assert torch.allclose(w, expect, atol=1e-12)
    assert torch.equal(corr.drop_mask(old, beh, MASK), torch.ones_like(MASK)) and not corr.masks


def test_sequence_tis_on_a_three_token_sequence_by_hand():
    # products 1.5 (under C = 2: kept), 3.0 (capped at 2), 0.375, 1.0 (the masked rho 10 is left out);
    # the sequence's weight on every one of its tokens
    old, beh = _pair(RHOS)
    corr = OffPolicyCorrection("sequence_tis", cap=2.0)
    w = corr.weights(old, beh, MASK)
    expect = torch.tensor([[1.5] * 3, [2.0] * 3, [0.375] * 3, [1.0] * 3], dtype=F64)
    assert torch.allclose(w, expect, atol=1e-12)
    # with a larger cap the product of row 1 shows: 2 x 1.5 x 1 = 3
    assert OffPolicyCorrection("sequence_tis", cap=5.0).weights(old, beh, MASK)[1, 0].item() == pytest.approx(3.0)
    assert torch.equal(corr.drop_mask(old, beh, MASK), torch.ones_like(MASK))


def test_sequence_log_rho_by_hand():
    # log 1.5, log 3, log 0.375, log 1 = 0
    old, beh = _pair(RHOS)
    expect = torch.tensor([math.log(1.5), math.log(3.0), math.log(0.375), 0.0], dtype=F64)
    assert torch.allclose(sequence_log_rho(old, beh, MASK), expect, atol=1e-12)


def test_token_mask_drops_exactly_the_tokens_outside_the_band():
    # band [0.5, 2]: row 0 drops 2.5 and 0.4, keeps 1.5 with weight 1.5; rows 1-2 keep everything (2.0 and
    # 0.5 are on the band's edges, up to rounding: take the band a hair wider); row 3's masked 10 is not dropped
    # by the correction (it is out of the loss mask already)
    old, beh = _pair(RHOS)
    corr = OffPolicyCorrection("token_mask", band_low=0.5 - 1e-9, band_high=2.0 + 1e-9)
    keep = corr.drop_mask(old, beh, MASK)
    assert keep.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    w = corr.weights(old, beh, MASK)
    # inside the band the weight is rho itself, uncapped
    assert w[0, 1].item() == pytest.approx(1.5) and w[1, 0].item() == pytest.approx(2.0)
    assert w[2, 0].item() == pytest.approx(0.5) and w[2, 2].item() == pytest.approx(1.5)
    assert corr.masks
    # a band closed on the tokens of rho exactly 1 keeps them: exp(0) = 1 on both edges
    exact = OffPolicyCorrection("token_mask", band_low=1.0, band_high=1.0)
    assert exact.drop_mask(old, beh, MASK)[1].tolist() == [0.0, 0.0, 1.0]


def test_sequence_mask_drops_whole_sequences():
    # products 1.5 (in [0.5, 2]: kept), 3.0 (out: whole row dropped), 0.375 (out: dropped), 1.0 (kept);
    # a kept sequence's every token is weighted by its product (sequence-level MIS)
    old, beh = _pair(RHOS)
    corr = OffPolicyCorrection("sequence_mask", band_low=0.5, band_high=2.0)
    keep = corr.drop_mask(old, beh, MASK)
    assert keep.tolist() == [[1.0] * 3, [0.0] * 3, [0.0] * 3, [1.0] * 3]
    weights = corr.weights(old, beh, MASK)
    assert weights[0].tolist() == pytest.approx([1.5] * 3) and weights[3].tolist() == pytest.approx([1.0] * 3)
    assert corr.masks
    # row 0 has tokens outside the token band (2.5, 0.4), yet the sequence is kept: the decision is the product's
    assert OffPolicyCorrection("token_mask").drop_mask(old, beh, MASK)[0].tolist() == [0.0, 1.0, 0.0]


def test_none_is_one():
    old, beh = _pair(RHOS)
    corr = OffPolicyCorrection("none")
    assert torch.equal(corr.weights(old, beh, MASK), torch.ones_like(MASK))
    assert torch.equal(corr.drop_mask(old, beh, MASK), torch.ones_like(MASK)) and not corr.masks


def test_huge_log_ratios_stay_finite():
    # three tokens of log-ratio 100 each: the sequence log-ratio 300 (exp(300) overflows float32) is clamped at
    # 80 -> over every cap and out of every band; -300 clamps at -80 -> weight exp(-80), not 0 or nan
    old = torch.full((1, 3), 100.0, dtype=F64)
    beh = torch.zeros(1, 3, dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    assert sequence_log_rho(old, beh, mask).item() == 80.0
    assert OffPolicyCorrection("sequence_tis", cap=2.0).weights(old, beh, mask)[0].tolist() == pytest.approx([2.0] * 3)
    assert OffPolicyCorrection("sequence_mask").drop_mask(old, beh, mask).tolist() == [[0.0, 0.0, 0.0]]
    low = OffPolicyCorrection("sequence_tis", cap=2.0).weights(-old, beh, mask)[0].tolist()
    assert low == pytest.approx([math.exp(-80)] * 3, rel=1e-12)


def test_weights_are_detached():
    old, beh = _pair(RHOS)
    old.requires_grad_(True)
    for name in CORRECTIONS:
        assert not OffPolicyCorrection(name).weights(old, beh, MASK).requires_grad, name


def test_unknown_correction_is_refused():
    with pytest.raises(ValueError, match="'vtrace'"):
        OffPolicyCorrection("vtrace")


def test_mismatch_by_hand():
    # unmasked log-rho: log 2, log 0.5 (row 0), and a masked log 10 (row 1)
    # log_ratio_sum = log 2 - log 2 = 0 ; max |log rho| = 0.693147 (the masked token counts as 0)
    # K3 = (2 - 1 - log 2) + (0.5 - 1 + log 2) = 0.306853 + 0.193147 = 0.5 ; tokens 2
    old, beh = _pair([[2.0, 0.5], [10.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)
    m = mismatch(old, beh, mask)
    assert m.log_ratio_sum == pytest.approx(0.0, abs=1e-12)
    assert m.max_abs == pytest.approx(math.log(2), abs=1e-12)
    assert m.k3_sum == pytest.approx(0.5, abs=1e-12)
    assert m.tokens == 2.0


def test_mismatch_k3_single_token_by_hand():
    # rho = 0.25: 0.25 - 1 - log 0.25 = -0.75 + 1.386294 = 0.636294
    old, beh = _pair([[0.25]])
    m = mismatch(old, beh, torch.ones(1, 1, dtype=F64))
    assert m.k3_sum == pytest.approx(0.636294, abs=1e-6)
    assert m.log_ratio_sum == pytest.approx(math.log(0.25)) and m.max_abs == pytest.approx(math.log(4))
