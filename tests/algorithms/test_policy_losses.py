"""Policy losses (``reflow.algorithms.policy_losses``) against numbers worked out by hand: PPO's clipped
surrogate with asymmetric bounds, dual-clip PPO's floor for negative advantages, GSPO's length-normalized
sequence ratio and CISPO's clipped, detached REINFORCE weight. Values and which tokens the clip held are
checked on tiny tensors, and the gradients d loss / d logp_new by autograd: PPO-clip passes -A r inside the
clip and nothing outside it, GSPO passes -s_i A_i / |y_i| to every token of a sequence under
seq_mean_token_mean, CISPO passes -w A even on a clipped token. Where two losses must differ the tests
assert by how much (dual-clip vs PPO-clip, GSPO vs PPO, CISPO vs PPO)."""

import math

import pytest
import torch

from reflow.algorithms.aggregation import Aggregation
from reflow.algorithms.policy_losses import (
    PolicyLossSettings,
    cispo,
    dual_clip,
    gspo,
    ppo_clip,
    sequence_log_ratio,
)


def _logp(ratios, old=0.0):
    """logp_new with gradients for the given ratios r = exp(logp_new - logp_old), logp_old = ``old``."""
    new = (torch.log(torch.tensor(ratios, dtype=torch.float64)) + old).requires_grad_(True)
    return new, torch.full_like(new, old).detach()


def test_ppo_clip_values_and_clipped_by_hand():
    # one token per sample, clip 0.2 / 0.2, logp_old = 0:
    #   r 1.5, A +1: min(1.5, 1.2) = 1.2      -> loss -1.2, clipped
    #   r 0.5, A -1: min(-0.5, -0.8) = -0.8   -> loss  0.8, clipped (the pessimistic side)
    #   r 0.9, A +1: min(0.9, 0.9)            -> loss -0.9
    #   r 1.1, A -1: min(-1.1, -1.1)          -> loss  1.1
    #   r 0.5, A +1: min(0.5, 0.8) = 0.5      -> loss -0.5 (a low ratio with A > 0 is not clipped)
    #   r 1.5, A -1: min(-1.5, -1.2) = -1.5   -> loss  1.5 (a high ratio with A < 0 is not clipped)
    #   r 1.3, A  0: 0                        -> loss  0
    new, old = _logp([[1.5], [0.5], [0.9], [1.1], [0.5], [1.5], [1.3]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    out = ppo_clip(new, old, adv, 0.2, 0.2)
    assert torch.allclose(out.loss[:, 0], torch.tensor([-1.2, 0.8, -0.9, 1.1, -0.5, 1.5, 0.0], dtype=torch.float64))
    assert out.clipped[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert not out.clipped.requires_grad


def test_ppo_clip_gradients_inside_and_outside_the_clip():
    # d(-r A)/d logp_new = -r A inside the clip, 0 where the clipped term is the min:
    #   r 1.5 A +1 -> 0 ; r 0.5 A -1 -> 0 ; r 0.9 A +1 -> -0.9 ; r 1.1 A -1 -> +1.1 ; r 0.5 A +1 -> -0.5 ;
    #   r 1.5 A -1 -> +1.5 ; A 0 -> 0
    new, old = _logp([[1.5], [0.5], [0.9], [1.1], [0.5], [1.5], [1.3]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    ppo_clip(new, old, adv, 0.2, 0.2).loss.sum().backward()
    assert torch.allclose(new.grad[:, 0], torch.tensor([0.0, 0.0, -0.9, 1.1, -0.5, 1.5, 0.0], dtype=torch.float64))


def test_ppo_clip_higher_is_asymmetric():
    # r 1.25 with A = +2: clip_high 0.2 -> -min(2.5, 2.4) = -2.4 (clipped, no gradient);
    # clip_high 0.28 -> -2.5 (inside, gradient -r A = -2.5). r 0.75 with A = -2: clip_low 0.2 caps at 0.8:
    # -min(-1.5, -1.6) = 1.6 (clipped) under both.
    new, old = _logp([[1.25, 0.75]])
    adv = torch.tensor([[2.0, -2.0]], dtype=torch.float64)
    sym = ppo_clip(new, old, adv, 0.2, 0.2)
    dapo = ppo_clip(new, old, adv, 0.2, 0.28)
    assert torch.allclose(sym.loss, torch.tensor([[-2.4, 1.6]], dtype=torch.float64))
    assert torch.allclose(dapo.loss, torch.tensor([[-2.5, 1.6]], dtype=torch.float64))
    assert (sym.loss - dapo.loss)[0, 0].item() == pytest.approx(0.1)
    assert sym.clipped.tolist() == [[1.0, 1.0]] and dapo.clipped.tolist() == [[0.0, 1.0]]
    (grad,) = torch.autograd.grad(dapo.loss.sum(), new)
    assert torch.allclose(grad, torch.tensor([[-2.5, 0.0]], dtype=torch.float64))


def test_per_sample_and_per_token_advantages_agree():
    new, old = _logp([[1.5, 0.9], [0.5, 1.1]])
    per_sample = ppo_clip(new, old, torch.tensor([1.0, -1.0], dtype=torch.float64), 0.2, 0.2).loss
    per_token = ppo_clip(new, old, torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64), 0.2, 0.2).loss
    # row 0 (A +1): -1.2, -0.9; row 1 (A -1): 0.8, 1.1
    assert torch.allclose(per_sample, torch.tensor([[-1.2, -0.9], [0.8, 1.1]], dtype=torch.float64))
    assert torch.equal(per_sample, per_token)


def test_dual_clip_bounds_a_negative_advantage_at_c_abs_a():
    # A = -2, r = 5, c = 3. PPO-clip: -min(-10, 1.2 x -2 = -2.4) = 10 = r |A|, not clipped, gradient -r A = 10.
    # Dual clip: min(10, -c A = 6) = 6 = c |A|, held (gradient 0). They differ by (r - c) |A| = 4.
    new, old = _logp([[5.0]])
    adv = torch.tensor([-2.0], dtype=torch.float64)
    ppo = ppo_clip(new, old, adv, 0.2, 0.2)
    dual = dual_clip(new, old, adv, 0.2, 0.2, 3.0)
    assert ppo.loss.item() == pytest.approx(10.0) and dual.loss.item() == pytest.approx(6.0)
    assert (ppo.loss - dual.loss).item() == pytest.approx(4.0)
    assert ppo.clipped.item() == 0.0 and dual.clipped.item() == 1.0
    (g_ppo,) = torch.autograd.grad(ppo.loss.sum(), new)
    (g_dual,) = torch.autograd.grad(dual.loss.sum(), new)
    assert g_ppo.item() == pytest.approx(10.0) and g_dual.item() == 0.0


def test_dual_clip_equals_ppo_clip_elsewhere():
    # A < 0 with r = 2 < c = 3: PPO loss 2 |A| = 2 is under the floor 3 -> unchanged, gradient -r A = 2.
    # A > 0 with r = 5: both -1.2 (the upper clip), clipped. A < 0 with r = 0.5: both 0.8 (the lower clip).
    new, old = _logp([[2.0], [5.0], [0.5]])
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    ppo = ppo_clip(new, old, adv, 0.2, 0.2)
    dual = dual_clip(new, old, adv, 0.2, 0.2, 3.0)
    assert torch.allclose(dual.loss[:, 0], torch.tensor([2.0, -1.2, 0.8], dtype=torch.float64))
    assert torch.equal(dual.loss, ppo.loss)
    assert dual.clipped[:, 0].tolist() == [0.0, 1.0, 1.0]
    (grad,) = torch.autograd.grad(dual.loss.sum(), new)
    assert torch.allclose(grad[:, 0], torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64))


def test_sequence_log_ratio_by_hand():
    # row 0: (0.3 - 0.3 + 0.0003) / 3 = 0.0001; row 1: the masked 5.0 is left out: (0.001 + 0) / 2 = 0.0005;
    # row 2: nothing unmasked -> 0 (the count is clamped to 1)
    diff = torch.tensor([[0.3, -0.3, 0.0003], [0.001, 0.0, 5.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float64)
    out = sequence_log_ratio(diff, torch.zeros_like(diff), mask)
    assert torch.allclose(out, torch.tensor([0.0001, 0.0005, 0.0], dtype=torch.float64), atol=1e-15)


def _gspo_batch():
    # row 0: token log-ratios 0.3, -0.3, 0.0003 -> s_0 = exp(0.0001) = 1.000100005, inside [1 - 3e-4, 1 + 4e-4]
    # row 1: 0.001, 0.0 and a masked 5.0 -> s_1 = exp(0.0005) = 1.000500125 > 1.0004: clipped for A_1 > 0
    old = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.01]], dtype=torch.float64))
    diff = torch.tensor([[0.3, -0.3, 0.0003], [0.001, 0.0, 5.0]], dtype=torch.float64)
    new = (old + diff).requires_grad_(True)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([2.0, 1.0], dtype=torch.float64)
    return new, old, adv, mask


def test_gspo_values_by_hand():
    new, old, adv, mask = _gspo_batch()
    out = gspo(new, old, adv, mask, 3e-4, 4e-4)
    s0 = math.exp(0.0001)
    # row 0: every token -s_0 A_0 = -2.00020001; row 1: -min(s_1, 1.0004) A_1 = -1.0004, clipped
    assert torch.allclose(out.loss[0], torch.full((3,), -2 * s0, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(out.loss[1, :2], torch.full((2,), -1.0004, dtype=torch.float64), atol=1e-12)
    assert out.clipped[0].tolist() == [0.0, 0.0, 0.0] and out.clipped[1, :2].tolist() == [1.0, 1.0]


def test_gspo_gradient_under_seq_mean_token_mean_is_s_a_over_length():
    # loss = (1/2) [ (1/3) sum_t l_0t + (1/2) sum_t l_1t ]; d/d logp_new_0t = -(1/2)(1/3) s_0 A_0 = -s_0 / 3
    # = -0.333366668 on each of row 0's tokens (the sequence ratio's gradient spread evenly over |y| = 3);
    # row 1 is clipped -> 0, and its masked token gets nothing.
    new, old, adv, mask = _gspo_batch()
    agg = Aggregation("seq_mean_token_mean")
    weights = torch.ones(2, dtype=torch.float64)
    per_token = gspo(new, old, adv, mask, 3e-4, 4e-4).loss
    loss = agg.numerator(per_token, mask, weights) / agg.denominator(mask, weights)
    s0 = math.exp(0.0001)
    assert loss.item() == pytest.approx(0.5 * (-2 * s0) + 0.5 * (-1.0004), abs=1e-12)
    loss.backward()
    expect = torch.tensor([[-s0 / 3] * 3, [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(new.grad, expect, atol=1e-12)
    # the true sequence-level objective -(1/2) s_0(logp_new) A_0 has exactly this gradient
    row0 = new[0].detach().clone().requires_grad_(True)
    seq_loss = -0.5 * torch.exp((row0 - old[0]).mean()) * adv[0]
    seq_loss.backward()
    assert torch.allclose(row0.grad, expect[0], atol=1e-12)


def test_gspo_differs_from_ppo_where_token_ratios_differ_but_the_sequence_ratio_is_inside():
    # Row 0 of the batch, A = 2, clip 0.2 for PPO: token ratios e^0.3 = 1.349859 (clipped at 1.2),
    # e^-0.3 = 0.740818, e^0.0003 = 1.0003 -> PPO losses -2.4, -1.481636, -2.0006, PPO gradients 0, -1.481636,
    # -2.0006. GSPO: -2 s_0 = -2.0002 on every token, gradient -2 s_0 on every token (per token, unaggregated).
    new, old, adv, mask = _gspo_batch()
    new, old, adv, mask = new[:1].detach().requires_grad_(True), old[:1], adv[:1], mask[:1]
    ppo = ppo_clip(new, old, adv, 0.2, 0.2)
    seq = gspo(new, old, adv, mask, 3e-4, 4e-4)
    s0 = math.exp(0.0001)
    assert torch.allclose(ppo.loss[0], torch.tensor([-2.4, -2 * math.exp(-0.3), -2 * math.exp(0.0003)], dtype=torch.float64))
    assert torch.allclose(seq.loss[0], torch.full((3,), -2 * s0, dtype=torch.float64))
    # by how much: token 0 by 2.4 - 2.0002 = 0.3998, token 1 by 1.481636 - 2.0002 = -0.518564
    diff = (seq.loss - ppo.loss)[0]
    assert diff[0].item() == pytest.approx(2.4 - 2 * s0, abs=1e-12)
    assert diff[1].item() == pytest.approx(2 * math.exp(-0.3) - 2 * s0, abs=1e-12)
    assert ppo.clipped[0].tolist() == [1.0, 0.0, 0.0] and seq.clipped[0].tolist() == [0.0, 0.0, 0.0]
    (g_ppo,) = torch.autograd.grad(ppo.loss.sum(), new)
    (g_seq,) = torch.autograd.grad(seq.loss.sum(), new)
    assert torch.allclose(g_ppo[0], torch.tensor([0.0, -2 * math.exp(-0.3), -2 * math.exp(0.0003)], dtype=torch.float64))
    assert torch.allclose(g_seq[0], torch.full((3,), -2 * s0, dtype=torch.float64))


def test_gspo_negative_advantage_clipped_below():
    # s = exp(-0.001) = 0.9990005 < 1 - 3e-4 with A = -1: -min(-s, -(0.9997)) = 0.9997, clipped, no gradient
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.full((1, 2), -0.001, dtype=torch.float64, requires_grad=True)
    out = gspo(new, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), 3e-4, 4e-4)
    assert torch.allclose(out.loss, torch.full((1, 2), 0.9997, dtype=torch.float64))
    assert out.clipped.tolist() == [[1.0, 1.0]]
    (grad,) = torch.autograd.grad(out.loss.sum(), new)
    assert grad.abs().max().item() == 0.0


def test_cispo_values_and_gradient_by_hand():
    # logp_old = log 0.1, logp_new = log 0.6 -> r = 6, A = +1, bounds (no lower, 1 + 4 = 5): w = 5, clipped.
    # loss = -5 x 1 x log 0.6 = 2.554128; gradient -w A = -5.
    # second token: logp_old = log 0.5, logp_new = log 0.25 -> r = 0.5, A = +1: w = 0.5 (no lower bound),
    # loss = -0.5 log 0.25 = 0.693147, gradient -0.5, not clipped.
    old = torch.log(torch.tensor([[0.1, 0.5]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.6, 0.25]], dtype=torch.float64)).requires_grad_(True)
    out = cispo(new, old, torch.tensor([1.0], dtype=torch.float64), 1.0, 4.0)
    assert torch.allclose(out.loss, torch.tensor([[-5 * math.log(0.6), -0.5 * math.log(0.25)]], dtype=torch.float64))
    assert out.loss[0, 0].item() == pytest.approx(2.554128, abs=1e-6)
    assert out.clipped.tolist() == [[1.0, 0.0]]
    (grad,) = torch.autograd.grad(out.loss.sum(), new)
    assert torch.allclose(grad, torch.tensor([[-5.0, -0.5]], dtype=torch.float64))


def test_cispo_lower_bound():
    # r = 0.5, A = -2, clip_low 0.2: w = max(0.5, 0.8) = 0.8, clipped; gradient -w A = 1.6
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.log(torch.tensor([[0.5]], dtype=torch.float64)).requires_grad_(True)
    out = cispo(new, old, torch.tensor([-2.0], dtype=torch.float64), 0.2, 4.0)
    assert out.clipped.item() == 1.0
    assert out.loss.item() == pytest.approx(1.6 * math.log(0.5))
    (grad,) = torch.autograd.grad(out.loss.sum(), new)
    assert grad.item() == pytest.approx(1.6)


def test_cispo_keeps_a_gradient_where_ppo_clip_gives_none():
    # r = 1.5 (logp_old log 0.4, logp_new log 0.6), A = +1, both clip at 1 + 0.2 = 1.2:
    # PPO-clip: loss -1.2, constant in logp_new -> gradient 0.
    # CISPO: w = sg[1.2], loss -1.2 log 0.6 = 0.612990, gradient -1.2: the token still trains.
    old = torch.log(torch.tensor([[0.4]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.6]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0], dtype=torch.float64)
    ppo = PolicyLossSettings("ppo_clip", clip_low=0.2, clip_high=0.2)(new, old, adv, torch.ones_like(old))
    cis = PolicyLossSettings("cispo", cispo_clip_low=0.2, cispo_clip_high=0.2)(new, old, adv, torch.ones_like(old))
    assert ppo.clipped.item() == 1.0 and cis.clipped.item() == 1.0
    assert ppo.loss.item() == pytest.approx(-1.2)
    assert cis.loss.item() == pytest.approx(-1.2 * math.log(0.6))
    (g_ppo,) = torch.autograd.grad(ppo.loss.sum(), new)
    (g_cis,) = torch.autograd.grad(cis.loss.sum(), new)
    assert g_ppo.item() == 0.0
    assert g_cis.item() == pytest.approx(-1.2)


def test_settings_dispatch_each_loss_with_its_own_bounds():
    # r 1.25 and 0.7 with A = -1, ppo bounds 0.1 / 0.1, dual c 1.1, gspo bounds 0.01 / 0.01, cispo 0.05 / 0.05
    #   ppo_clip:  -min(-1.25, -1.1) = 1.25 ; -min(-0.7, -0.9) = 0.9
    #   dual_clip: min(1.25, 1.1) = 1.1     ; 0.9 (under the floor 1.1)
    #   gspo:      s = exp((log 1.25 + log 0.7) / 2) = sqrt(0.875) = 0.935414 < 0.99 -> 0.99 on both tokens
    #   cispo:     w = clip(r, 0.95, 1.05) = 1.05, 0.95 -> -w A logp_new = 1.05 log(0.5 x 1.25), 0.95 log(0.5 x 0.7)
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.625, 0.35]], dtype=torch.float64))
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones_like(old)
    kwargs = dict(clip_low=0.1, clip_high=0.1, dual_clip_c=1.1, gspo_clip_low=0.01, gspo_clip_high=0.01,
                  cispo_clip_low=0.05, cispo_clip_high=0.05)
    expect = {
        "ppo_clip": [1.25, 0.9],
        "dual_clip": [1.1, 0.9],
        "gspo": [0.99, 0.99],
        "cispo": [1.05 * math.log(0.625), 0.95 * math.log(0.35)],
    }
    for name, values in expect.items():
        out = PolicyLossSettings(name, **kwargs)(new, old, adv, mask)
        assert torch.allclose(out.loss, torch.tensor([values], dtype=torch.float64), atol=1e-12), name


def test_settings_refuse_an_unknown_loss():
    with pytest.raises(ValueError, match="'reinforce'"):
        PolicyLossSettings("reinforce")


def test_ratio_one_gives_minus_advantage_for_every_clip_loss():
    # one update per batch: logp_old = logp_new detached -> r = 1, every clip loss is -A, its gradient -A
    for name in ("ppo_clip", "dual_clip", "gspo"):
        new = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64)).requires_grad_(True)
        out = PolicyLossSettings(name)(new, new.detach(), torch.tensor([-3.0], dtype=torch.float64), torch.ones(1, 2))
        assert torch.allclose(out.loss, torch.tensor([[3.0, 3.0]], dtype=torch.float64)), name
        assert out.clipped.sum().item() == 0.0, name
        (grad,) = torch.autograd.grad(out.loss.sum(), new)
        assert torch.allclose(grad, torch.tensor([[3.0, 3.0]], dtype=torch.float64)), name
