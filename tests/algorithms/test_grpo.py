"""GRPO math checked against numbers worked out by hand."""

import math

import pytest
import torch

from reflow.algorithms.grpo import (
    LossConfig,
    group_advantages,
    loss_denominator,
    replay_gradient_share,
    token_loss_terms,
    weighted_token_sum,
)


def test_group_advantages_by_hand():
    # group 0: rewards 1, 0 -> mean 0.5, std 0.5 -> +1, -1
    # group 1: rewards 1, 1, 1 -> std 0 -> all 0 (no signal)
    # group 2: rewards 0, 0.5, 1 -> mean .5, std sqrt(1/6)
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 1.0])
    g = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    adv = group_advantages(r, g, normalize_std=True, eps=0.0 + 1e-12)
    s = math.sqrt(1 / 6)
    expect = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, -0.5 / s, 0.0, 0.5 / s])
    assert torch.allclose(adv, expect, atol=1e-5)
    centred = group_advantages(r, g, normalize_std=False)
    assert torch.allclose(centred, torch.tensor([0.5, -0.5, 0, 0, 0, -0.5, 0, 0.5]))


def test_ratio_one_gives_minus_advantage():
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    out = token_loss_terms(lp, lp, lp, torch.tensor([2.0]), LossConfig())
    assert torch.allclose(out["loss"], torch.tensor([[-2.0, -2.0]]))
    assert out["clipped"].sum() == 0


def test_clipping_by_hand():
    # ratio 1.5 with A = +1: min(1.5, clip 1.2) = 1.2 -> loss -1.2, clipped
    # ratio 0.5 with A = -1: -min(-0.5, -0.8) = 0.8 -> clipped (pessimistic side)
    # ratio 0.9 with A = +1: unclipped, loss -0.9
    old = torch.zeros(3, 1)
    new = torch.log(torch.tensor([[1.5], [0.5], [0.9]]))
    adv = torch.tensor([1.0, -1.0, 1.0])
    out = token_loss_terms(new, old, old, adv, LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, is_cap=0))
    assert torch.allclose(out["loss"].squeeze(1), torch.tensor([-1.2, 0.8, -0.9]), atol=1e-6)
    assert out["clipped"].squeeze(1).tolist() == [1.0, 1.0, 0.0]


def test_asymmetric_clip_higher():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[1.25]]))
    out = token_loss_terms(new, old, old, torch.tensor([1.0]), LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, is_cap=0))
    assert torch.allclose(out["loss"], torch.tensor([[-1.25]]))  # inside [0.8, 1.28]


def test_truncated_importance_weight():
    # behavior prob 0.1, trainer prob 0.4 -> weight 4 truncated at 2; 0.4 vs 0.8 -> 0.5
    old = torch.log(torch.tensor([[0.4, 0.4]]))
    beh = torch.log(torch.tensor([[0.1, 0.8]]))
    out = token_loss_terms(old, old, beh, torch.tensor([1.0]), LossConfig(is_cap=2.0))
    assert torch.allclose(out["is_weight"], torch.tensor([[2.0, 0.5]]))
    assert torch.allclose(out["loss"], torch.tensor([[-2.0, -0.5]]))
    off = token_loss_terms(old, old, beh, torch.tensor([1.0]), LossConfig(is_cap=0))
    assert torch.allclose(off["is_weight"], torch.ones(1, 2))


def test_k3_kl_by_hand():
    new = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    out = token_loss_terms(new, new, new, torch.tensor([0.0]), LossConfig(kl_coef=0.1), logp_ref=ref)
    d = math.log(0.25) - math.log(0.5)
    k3 = math.exp(d) - d - 1
    assert out["kl"].item() == pytest.approx(k3, rel=1e-5)
    assert out["loss"].item() == pytest.approx(0.1 * k3, rel=1e-5)


def test_gradient_of_token_loss():
    # d/d(logp_new) of -ratio*A at ratio 1 is -A
    new = torch.zeros(1, 2, requires_grad=True)
    out = token_loss_terms(new, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([3.0]), LossConfig())
    out["loss"].sum().backward()
    assert torch.allclose(new.grad, torch.tensor([[-3.0, -3.0]]))


def test_weighted_token_normalization_two_ranks():
    """sum_i w_i sum_t l_it / sum_j w_j n_j, split over two 'ranks', equals the single-batch value."""
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    w = torch.tensor([1.0, 0.5, 1.0])  # sample 1 replayed with tau = 0.5
    # by hand: numerator 1*(1+2) + 0.5*3 + 1*3 = 7.5; denominator 1*2 + 0.5*1 + 1*3 = 5.5
    full = weighted_token_sum(values, mask, w) / loss_denominator(mask, w)
    assert full.item() == pytest.approx(7.5 / 5.5)
    den = loss_denominator(mask[:1], w[:1]) + loss_denominator(mask[1:], w[1:])  # the all-reduce
    split = weighted_token_sum(values[:1], mask[:1], w[:1]) / den + weighted_token_sum(values[1:], mask[1:], w[1:]) / den
    assert split.item() == pytest.approx(full.item())
    # Z = sum(w n) / sum(n): loss = (1/N) sum_i (w_i/Z) sum_t l_it
    N = mask.sum()
    Z = loss_denominator(mask, w) / N
    assert ((values * mask * (w / Z)[:, None]).sum() / N).item() == pytest.approx(full.item())


def test_replay_gradient_share():
    assert replay_gradient_share(0.0, 0.5) == 0.0
    assert replay_gradient_share(0.5, 1.0) == pytest.approx(0.5)
    # lambda = 0.5, tau = 0.5 -> 0.25 / 0.75
    assert replay_gradient_share(0.5, 0.5) == pytest.approx(1 / 3)
