"""The KL penalty (``reflow.algorithms.kl``) and the entropy (``reflow.algorithms.entropy``) against numbers
worked out by hand: the three per-token estimators k1, k2, k3 of KL(new || ref) and their gradients through
logp_new, the undiscounted reward-to-go over a masked row, the KL-shaped advantages A_i - beta sum_{s>=t} k_s
(detached), and the entropy of uniform, two-point and nearly one-hot distributions."""

import math

import pytest
import torch

from reflow.algorithms.entropy import entropy_from_logits
from reflow.algorithms.kl import kl_estimate, kl_shaped_advantages, reward_to_go

F64 = torch.float64
LN2 = math.log(2)


def test_estimators_by_hand_for_d_log_half():
    # new 0.5, ref 0.25: d = log(0.25 / 0.5) = -0.693147
    #   k1 = -d = 0.693147 ; k2 = d^2 / 2 = 0.240227 ; k3 = e^d - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    new = torch.log(torch.tensor([[0.5]], dtype=F64))
    ref = torch.log(torch.tensor([[0.25]], dtype=F64))
    assert kl_estimate(new, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(new, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_estimate(new, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_estimate(new, ref).item() == kl_estimate(new, ref, "k3").item()  # k3 the default


def test_estimators_by_hand_for_d_log_two():
    # new 0.25, ref 0.5: d = +0.693147: k1 = -0.693147 (k1 can be negative), k2 = 0.240227, k3 = 2 - 0.693147 - 1
    new = torch.log(torch.tensor([[0.25]], dtype=F64))
    ref = torch.log(torch.tensor([[0.5]], dtype=F64))
    assert kl_estimate(new, ref, "k1").item() == pytest.approx(-LN2)
    assert kl_estimate(new, ref, "k2").item() == pytest.approx(LN2**2 / 2)
    assert kl_estimate(new, ref, "k3").item() == pytest.approx(1 - LN2)


def test_estimators_are_zero_when_equal():
    lp = torch.log(torch.tensor([[0.1, 0.7]], dtype=F64))
    for est in ("k1", "k2", "k3"):
        assert kl_estimate(lp, lp, est).abs().max().item() == 0.0


def test_estimator_gradients_by_hand():
    # d = logp_ref - logp_new = -log 2: d k1 / d logp_new = 1 ; d k2 = -d = 0.693147 ; d k3 = 1 - e^d = 0.5
    for est, want in (("k1", 1.0), ("k2", LN2), ("k3", 0.5)):
        new = torch.log(torch.tensor([[0.5]], dtype=F64)).requires_grad_(True)
        ref = torch.log(torch.tensor([[0.25]], dtype=F64))
        kl_estimate(new, ref, est).sum().backward()
        assert new.grad.item() == pytest.approx(want), est


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_reward_to_go_on_a_masked_row():
    # x 1, 2, 3, 4 with mask 1, 0, 1, 0 -> masked 1, 0, 3, 0 -> sums from t on: 4, 3, 3, 0
    # second row all kept: 1, 1, 1, 1 -> 4, 3, 2, 1
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
    assert reward_to_go(x, mask).tolist() == [[4.0, 3.0, 3.0, 0.0], [4.0, 3.0, 2.0, 1.0]]


def test_kl_shaped_advantages_by_hand():
    # k1 = logp_new - logp_ref, beta 0.5
    #   row 0: k 0.1, 0.2, 0.3 -> to-go 0.6, 0.5, 0.3 -> 1 - 0.5 x (0.6, 0.5, 0.3) = 0.7, 0.75, 0.85
    #   row 1: k 0.4, -0.2, (9.0 masked) -> to-go 0.2, -0.2, 0 -> -0.5 - 0.5 x (0.2, -0.2, 0) = -0.6, -0.4, -0.5
    ref = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.01]], dtype=F64))
    new = (ref + torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 9.0]], dtype=F64)).requires_grad_(True)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=F64)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    out = kl_shaped_advantages(adv, new, ref, mask, coef=0.5, estimator="k1")
    expect = torch.tensor([[0.7, 0.75, 0.85], [-0.6, -0.4, -0.5]], dtype=F64)
    assert torch.allclose(out, expect, atol=1e-12)
    assert not out.requires_grad  # the penalty is a reward: no gradient through it


def test_kl_shaped_advantages_with_k3_by_hand():
    # one token, d = -log 2: k3 = 0.193147; A = 1, beta 0.1: 1 - 0.0193147 = 0.980685; coef 0 leaves A
    new = torch.log(torch.tensor([[0.5]], dtype=F64))
    ref = torch.log(torch.tensor([[0.25]], dtype=F64))
    one = torch.ones(1, 1, dtype=F64)
    adv = torch.tensor([1.0], dtype=F64)
    assert kl_shaped_advantages(adv, new, ref, one, 0.1, "k3").item() == pytest.approx(1 - 0.1 * (0.5 - 1 + LN2))
    assert kl_shaped_advantages(adv, new, ref, one, 0.0, "k3").item() == 1.0


def test_entropy_of_uniform_logits_is_log_v():
    # V = 7 equal logits (any shift): H = log 7 = 1.945910
    logits = torch.full((2, 3, 7), 4.2)
    assert torch.allclose(entropy_from_logits(logits), torch.full((2, 3), math.log(7)), atol=1e-6)
    assert entropy_from_logits(torch.zeros(5)).item() == pytest.approx(math.log(5), abs=1e-6)


def test_entropy_of_two_points_by_hand():
    # logits 0, log 3 -> p = 0.25, 0.75: H = 0.25 log 4 + 0.75 log(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([0.0, math.log(3.0)], dtype=F64)
    assert entropy_from_logits(logits).item() == pytest.approx(0.562335, abs=1e-6)
    assert entropy_from_logits(logits + 50.0).item() == pytest.approx(0.562335, abs=1e-6)


def test_entropy_of_a_nearly_one_hot_distribution_is_near_zero():
    # logits 30, 0, 0, 0: p_others = e^-30 each ~ 9.4e-14; H ~ 3 x 9.4e-14 x 31 ~ 8.7e-12
    logits = torch.tensor([30.0, 0.0, 0.0, 0.0])
    h = entropy_from_logits(logits).item()
    assert abs(h) < 1e-6
