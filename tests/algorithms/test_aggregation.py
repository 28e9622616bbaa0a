"""Loss aggregation (``reflow.algorithms.aggregation``): the four aggregations' per-sample scales,
denominators and losses against numbers worked out by hand (with replay weights and a fully masked row),
the exact difference between token_mean and seq_mean_token_mean on sequences of different lengths, and
the replayed samples' gradient share. The central property is proved with a tiny real policy in float64:
for every aggregation, splitting a minibatch's rows over data-parallel ranks and each rank's rows over
micro-batches, backpropagating each micro-batch's numerator over the all-reduced global denominator,
accumulates exactly the gradient of the one full-batch loss (atol 1e-12); and a naive mean of per-micro-batch
losses does not, so the test can fail."""

import pytest
import torch

from reflow.algorithms.aggregation import AGGREGATIONS, Aggregation, replay_gradient_share
from reflow.algorithms.off_policy import OffPolicyCorrection
from reflow.algorithms.policy_losses import PolicyLossSettings

F64 = torch.float64

# Two sequences of different lengths and a fully masked third one:
#   row 0: losses 1, 2, 3 (n = 3, token sum 6, token mean 2)
#   row 1: losses 4, (9), (9) masked after the first (n = 1, sum 4, mean 4)
#   row 2: every token masked (n = 0): leaves the loss and every denominator
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)


def _loss(name, weights, norm_tokens=4.0):
    agg = Aggregation(name, norm_tokens)
    return (agg.numerator(VALUES, MASK, weights) / agg.denominator(MASK, weights)).item()


def test_losses_by_hand_fresh():
    w = torch.ones(3, dtype=F64)
    # token_mean (1 + 2 + 3 + 4) / 4 = 2.5 ; seq_mean_token_mean (2 + 4) / 2 = 3 ; seq_mean_token_sum (6 + 4) / 2 = 5
    # token_sum_norm, L = 4: (6 + 4) / (2 x 4) = 1.25
    assert _loss("token_mean", w) == pytest.approx(2.5, abs=1e-15)
    assert _loss("seq_mean_token_mean", w) == pytest.approx(3.0, abs=1e-15)
    assert _loss("seq_mean_token_sum", w) == pytest.approx(5.0, abs=1e-15)
    assert _loss("token_sum_norm", w) == pytest.approx(1.25, abs=1e-15)


def test_losses_by_hand_with_replay_weights():
    # row 1 replayed at tau = 0.5 (row 2 also 0.5, but fully masked: no effect)
    w = torch.tensor([1.0, 0.5, 0.5], dtype=F64)
    # token_mean: (6 + 0.5 x 4) / (3 + 0.5 x 1) = 8 / 3.5 = 2.285714
    # seq_mean_token_mean: (2 + 0.5 x 4) / (1 + 0.5) = 4 / 1.5 = 2.666667
    # seq_mean_token_sum: (6 + 0.5 x 4) / 1.5 = 5.333333 ; token_sum_norm: 8 / (1.5 x 4) = 1.333333
    assert _loss("token_mean", w) == pytest.approx(8 / 3.5, abs=1e-15)
    assert _loss("seq_mean_token_mean", w) == pytest.approx(4 / 1.5, abs=1e-15)
    assert _loss("seq_mean_token_sum", w) == pytest.approx(8 / 1.5, abs=1e-15)
    assert _loss("token_sum_norm", w) == pytest.approx(8 / 6, abs=1e-15)


def test_sample_scale_and_denominator_by_hand():
    w = torch.tensor([1.0, 0.5, 0.5], dtype=F64)
    # c_i: token_mean w; seq_mean_token_mean w / n (n clamped to 1): 1/3, 0.5, 0.5
    assert Aggregation("token_mean").sample_scale(MASK, w).tolist() == [1.0, 0.5, 0.5]
    assert torch.allclose(Aggregation("seq_mean_token_mean").sample_scale(MASK, w), torch.tensor([1 / 3, 0.5, 0.5], dtype=F64))
    assert Aggregation("seq_mean_token_sum").sample_scale(MASK, w).tolist() == [1.0, 0.5, 0.5]
    assert Aggregation("token_sum_norm", 4.0).sample_scale(MASK, w).tolist() == [1.0, 0.5, 0.5]
    # sum d_i: token_mean 3 + 0.5 = 3.5 ; the sequence ones 1 + 0.5 = 1.5 (row 2 has no tokens) ; token_sum_norm x 4
    dens = {name: Aggregation(name, 4.0).denominator(MASK, w) for name in AGGREGATIONS}
    assert {k: v.item() for k, v in dens.items()} == {
        "token_mean": 3.5, "seq_mean_token_mean": 1.5, "seq_mean_token_sum": 1.5, "token_sum_norm": 6.0,
    }
    assert all(v.dtype == F64 for v in dens.values())
    # the numerators: token_mean / seq_mean_token_sum / token_sum_norm 6 + 2 = 8 ; seq_mean_token_mean 2 + 2 = 4
    assert Aggregation("token_mean").numerator(VALUES, MASK, w).item() == 8.0
    assert Aggregation("seq_mean_token_mean").numerator(VALUES, MASK, w).item() == pytest.approx(4.0, abs=1e-15)


def test_token_mean_and_seq_mean_token_mean_differ_exactly():
    # 2.5 vs 3: the short row's token counts once among 4 tokens under token_mean, half the loss under
    # seq_mean_token_mean. With per-token gradients: token_mean gives every token 1/4; seq_mean_token_mean
    # gives row 0's tokens 1/(2 x 3) = 1/6 and row 1's token 1/2.
    w = torch.ones(3, dtype=F64)
    assert _loss("seq_mean_token_mean", w) - _loss("token_mean", w) == pytest.approx(0.5, abs=1e-15)
    grads = {}
    for name in ("token_mean", "seq_mean_token_mean"):
        values = VALUES.clone().requires_grad_(True)
        agg = Aggregation(name)
        (agg.numerator(values, MASK, w) / agg.denominator(MASK, w)).backward()
        grads[name] = values.grad
    assert torch.allclose(grads["token_mean"], MASK / 4)
    assert torch.allclose(grads["seq_mean_token_mean"], torch.tensor([[1 / 6] * 3, [0.5, 0, 0], [0, 0, 0]], dtype=F64))


def test_token_sum_norm_is_seq_mean_token_sum_over_l():
    # the same sums, one divides by the number of sequences, the other by that times L
    w = torch.tensor([1.0, 0.5, 0.5], dtype=F64)
    assert _loss("seq_mean_token_sum", w) / _loss("token_sum_norm", w, norm_tokens=8.0) == pytest.approx(8.0)


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="'sum'"):
        Aggregation("sum")


def test_replay_gradient_share_by_hand():
    # lambda 0.25, tau 0.5: 0.125 / (0.75 + 0.125) = 1/7 ; no replay 0 ; all replayed 1 ; all replayed at tau 0 -> 0
    assert replay_gradient_share(0.25, 0.5) == pytest.approx(1 / 7)
    assert replay_gradient_share(0.0, 0.5) == 0.0
    assert replay_gradient_share(1.0, 0.5) == pytest.approx(1.0)
    assert replay_gradient_share(1.0, 0.0) == 0.0
    assert replay_gradient_share(0.5, 1.0) == pytest.approx(0.5)


def test_replay_gradient_share_matches_the_token_mean_loss():
    # 4 samples of 2 tokens, 1 replayed (lambda 1/4) at tau 0.5, per-token loss 1: the replayed sample's part of
    # the token_mean loss is 0.5 x 2 / (3 x 2 + 0.5 x 2) = 1/7
    mask = torch.ones(4, 2, dtype=F64)
    w = torch.tensor([1.0, 1.0, 1.0, 0.5], dtype=F64)
    agg = Aggregation("token_mean")
    den = agg.denominator(mask, w)
    replayed = agg.numerator(torch.ones(1, 2, dtype=F64), mask[3:], w[3:]) / den
    total = agg.numerator(torch.ones(4, 2, dtype=F64), mask, w) / den
    assert (replayed / total).item() == pytest.approx(replay_gradient_share(0.25, 0.5))


# ---- micro-batch / rank equivalence with a real policy -------------------------------------------------

VOCAB, HIDDEN, T = 7, 5, 4
# 6 rows; lengths 4, 2, 3, 0 (fully masked), 4 with a masked tool-output token, 1
LOSS_MASK = torch.tensor(
    [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0]], dtype=F64
)
REPLAY_W = torch.tensor([1.0, 0.5, 1.0, 1.0, 0.5, 1.0], dtype=F64)  # rows 1 and 4 replayed at tau = 0.5
ADVANTAGES = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.5, 0.7], dtype=F64)
# rank -> micro-batches of row indices (disjoint, covering all 6 rows); micro-batches of 1-2 rows
SPLITS = {
    "2 ranks": [[[0, 1], [2]], [[3, 4], [5]]],
    "3 ranks": [[[5], [0]], [[2, 3]], [[1], [4]]],
}


class TinyPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(inputs)))
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


def _setup():
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    policy = TinyPolicy().to(F64)
    inputs = torch.randint(0, VOCAB, (6, T), generator=gen)
    targets = torch.randint(0, VOCAB, (6, T), generator=gen)
    with torch.no_grad():
        logp = policy(inputs, targets)
    # behaviour log-probs near the trainer's (engine mismatch); fixed "old" log-probs for a later PPO epoch,
    # far enough that some ratios leave the 0.8-1.2 clip
    logp_behavior = logp + 0.05 * torch.randn(6, T, generator=gen, dtype=F64)
    logp_old_fixed = logp + 0.3 * torch.randn(6, T, generator=gen, dtype=F64)
    return policy, inputs, targets, logp_behavior, logp_old_fixed


def _token_loss(policy, inputs, targets, rows, old_mode, logp_behavior, logp_old_fixed, loss_name):
    """The per-token loss of ``rows`` (a fresh forward pass over those rows only), times the token_tis weight."""
    logp_new = policy(inputs[rows], targets[rows])
    logp_old = logp_new.detach() if old_mode == "one update" else logp_old_fixed[rows]
    mask = LOSS_MASK[rows]
    out = PolicyLossSettings(loss_name)(logp_new, logp_old, ADVANTAGES[rows], mask)
    tis = OffPolicyCorrection("token_tis", cap=2.0).weights(logp_old, logp_behavior[rows], mask)
    return out.loss * tis, mask, REPLAY_W[rows], out.clipped


def _grads(policy):
    return [p.grad.detach().clone() for p in policy.parameters()]


def _full_batch_grads(name, old_mode, loss_name):
    policy, inputs, targets, behavior, fixed = _setup()
    agg = Aggregation(name, norm_tokens=float(T))
    rows = list(range(6))
    values, mask, w, clipped = _token_loss(policy, inputs, targets, rows, old_mode, behavior, fixed, loss_name)
    (agg.numerator(values, mask, w) / agg.denominator(mask, w)).backward()
    return _grads(policy), clipped


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("old_mode", ["one update", "fixed old"])
@pytest.mark.parametrize("name", AGGREGATIONS)
def test_ranks_and_micro_batches_accumulate_the_full_batch_gradient(name, old_mode, split):
    full, clipped = _full_batch_grads(name, old_mode, "ppo_clip")
    if old_mode == "fixed old":
        assert 0 < (clipped * LOSS_MASK).sum() < LOSS_MASK.sum()  # the clip is exercised on some tokens
    assert max(g.abs().max().item() for g in full) > 1e-3  # a gradient worth comparing

    policy, inputs, targets, behavior, fixed = _setup()
    agg = Aggregation(name, norm_tokens=float(T))
    ranks = SPLITS[split]
    # each rank knows its own rows' denominator share before the forward pass; all-reduce (sum) it once
    global_den = sum(agg.denominator(LOSS_MASK[[r for mb in rank for r in mb]], REPLAY_W[[r for mb in rank for r in mb]])
                     for rank in ranks)
    # every rank's micro-batches backpropagate numerator / global_den; the all-reduce of gradients is their sum
    for rank in ranks:
        for mb in rank:
            values, mask, w, _ = _token_loss(policy, inputs, targets, mb, old_mode, behavior, fixed, "ppo_clip")
            (agg.numerator(values, mask, w) / global_den).backward()
    for got, want in zip(_grads(policy), full):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max().item()


@pytest.mark.parametrize("loss_name", ["dual_clip", "gspo", "cispo"])
@pytest.mark.parametrize("name", AGGREGATIONS)
def test_equivalence_holds_for_the_other_policy_losses(name, loss_name):
    # every policy loss is row-separable (GSPO's sequence ratio included), so the split is exact for each
    full, _ = _full_batch_grads(name, "fixed old", loss_name)
    assert max(g.abs().max().item() for g in full) > 1e-2  # not a trivially equal zero gradient
    policy, inputs, targets, behavior, fixed = _setup()
    agg = Aggregation(name, norm_tokens=float(T))
    global_den = agg.denominator(LOSS_MASK[[0, 1, 2]], REPLAY_W[[0, 1, 2]]) + agg.denominator(
        LOSS_MASK[[3, 4, 5]], REPLAY_W[[3, 4, 5]]
    )
    for mb in ([0], [1, 2], [3, 4], [5]):
        values, mask, w, _ = _token_loss(policy, inputs, targets, mb, "fixed old", behavior, fixed, loss_name)
        (agg.numerator(values, mask, w) / global_den).backward()
    for got, want in zip(_grads(policy), full):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", AGGREGATIONS)
def test_naive_mean_of_micro_batch_losses_does_not_match(name):
    # Each micro-batch normalized by its own denominator, the losses averaged: with unequal lengths and
    # micro-batches of unequal size this weights rows wrongly. (No micro-batch here is all masked: [3, 4].)
    full, _ = _full_batch_grads(name, "one update", "ppo_clip")
    policy, inputs, targets, behavior, fixed = _setup()
    agg = Aggregation(name, norm_tokens=float(T))
    micro_batches = [[0, 1], [2], [3, 4], [5]]
    for mb in micro_batches:
        values, mask, w, _ = _token_loss(policy, inputs, targets, mb, "one update", behavior, fixed, "ppo_clip")
        (agg.numerator(values, mask, w) / agg.denominator(mask, w) / len(micro_batches)).backward()
    gap = max((got - want).abs().max().item() for got, want in zip(_grads(policy), full))
    assert gap > 1e-6
