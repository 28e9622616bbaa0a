"""Advantage estimators (``reflow.algorithms.advantages``) against numbers worked out by hand: GRPO's
group-normalized advantage with the population std, Dr. GRPO's plain centring, RLOO's leave-one-out
baseline and REINFORCE++'s batch whitening (with and without the group baseline). The tests also pin the
exact relations between the variants (GRPO = Dr. GRPO / (std + eps), RLOO = G / (G - 1) x Dr. GRPO), show
that the two-stage form the trainer runs (``group_stage`` per finished group, then ``batch_stage`` with
statistics reduced over ranks) composes to the full estimator, and that bad input is refused."""

import math

import pytest
import torch

from reflow.algorithms.advantages import AdvantageEstimator, dr_grpo, grpo, reinforce_pp, rloo, whiten

# Three groups, interleaved on purpose (a batch is not sorted by group):
#   group 0: rewards 1, 0, 0, 1   mean 0.5  population std 0.5
#   group 1: rewards 0.5, 1, 0    mean 0.5  population std sqrt((0 + .25 + .25) / 3) = sqrt(1/6) = 0.408248
#   group 2: rewards 1, 1         mean 1    std 0 (no signal)
REWARDS = torch.tensor([1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 1, 0, 2, 1, 0, 1, 2, 0])
STD1 = math.sqrt(1 / 6)


def test_grpo_by_hand():
    # group 0: (1 - .5) / .5 = +1, (0 - .5) / .5 = -1; group 1: 0, .5 / .408248 = 1.224745, -1.224745; group 2: 0
    # (eps 1e-12: ``advantage.eps`` must be > 0, and group 2's 0 / 0 needs it)
    adv = grpo(REWARDS, GROUPS, eps=1e-12)
    expect = torch.tensor([1.0, 0.0, -1.0, 0.0, 1.224745, -1.0, -1.224745, 0.0, 1.0])
    assert torch.allclose(adv, expect, atol=1e-6)
    assert adv.dtype == torch.float32


def test_grpo_with_eps_by_hand():
    # eps = 0.1: group 0 -> +-0.5 / 0.6 = +-0.833333; group 1 -> +-0.5 / 0.508248 = +-0.983770
    adv = grpo(REWARDS, GROUPS, eps=0.1)
    expect = torch.tensor([0.833333, 0.0, -0.833333, 0.0, 0.983770, -0.833333, -0.983770, 0.0, 0.833333])
    assert torch.allclose(adv, expect, atol=1e-6)


def test_grpo_uses_population_not_sample_std():
    # group 0 with the sample std (n - 1) would be sqrt(1/3) = 0.57735 -> +-0.866; population std 0.5 -> +-1
    adv = grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), eps=1e-12)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)


def test_equal_rewards_and_singleton_group_give_zero():
    # all-equal group: r - mean = 0, std 0 -> 0 / eps = 0 (not nan); a group of one sample: likewise
    adv = grpo(torch.tensor([0.7, 0.7, 0.7, 0.3]), torch.tensor([0, 0, 0, 1]))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


# equal rewards that are not exact in binary: in float32 r - mean is one ulp (5.96e-8), as is the population
# std, and A would be 5.96e-8 / (5.96e-8 + 1e-6) = 0.056 for every member; the group stage reduces in float64
@pytest.mark.parametrize("value, size", [(0.9, 3), (2 / 3, 8)])
def test_equal_rewards_that_are_not_exact_in_binary_give_zero(value, size):
    adv = grpo(torch.full((size,), value), torch.zeros(size, dtype=torch.long))
    assert adv.abs().max().item() < 1e-3


def test_dr_grpo_by_hand():
    # r - mean_g: group 0 +-0.5, group 1: 0, 0.5, -0.5, group 2: 0
    adv = dr_grpo(REWARDS, GROUPS)
    expect = torch.tensor([0.5, 0.0, -0.5, 0.0, 0.5, -0.5, -0.5, 0.0, 0.5])
    assert torch.allclose(adv, expect, atol=1e-7)


def test_grpo_differs_from_dr_grpo_by_one_over_std_plus_eps():
    eps = 1e-6
    g, d = grpo(REWARDS, GROUPS, eps), dr_grpo(REWARDS, GROUPS)
    factor = torch.tensor([1 / (0.5 + eps) if k == 0 else 1 / (STD1 + eps) if k == 1 else 1.0 for k in GROUPS.tolist()])
    assert torch.allclose(g, d * factor, atol=1e-6)
    # and the difference is real: group 0 doubles (1 vs 0.5), group 1 is x2.449
    assert abs(g[0].item() - d[0].item()) == pytest.approx(0.5, abs=1e-5)
    assert g[4].item() / d[4].item() == pytest.approx(1 / STD1, rel=1e-5)


def test_rloo_by_hand():
    # group 0 (G = 4): 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3
    # group 1 (G = 3): .5 - (1 + 0) / 2 = 0, 1 - (.5 + 0) / 2 = .75, 0 - (.5 + 1) / 2 = -.75
    # group 2 (G = 2): 1 - 1 = 0
    adv = rloo(REWARDS, GROUPS)
    expect = torch.tensor([2 / 3, 0.0, -2 / 3, 0.0, 0.75, -2 / 3, -0.75, 0.0, 2 / 3])
    assert torch.allclose(adv, expect, atol=1e-6)


def test_rloo_is_g_over_g_minus_one_times_dr_grpo():
    d, r = dr_grpo(REWARDS, GROUPS), rloo(REWARDS, GROUPS)
    sizes = torch.tensor([float((GROUPS == k).sum()) for k in GROUPS.tolist()])  # 4, 3, 4, 2, 3, 4, 3, 2, 4
    assert torch.allclose(r, sizes / (sizes - 1) * d, atol=1e-6)
    # group 0: 4/3 x 0.5 = 0.6667 vs 0.5; group 1: 3/2 x 0.5 = 0.75 vs 0.5
    assert r[0].item() - d[0].item() == pytest.approx(1 / 6, abs=1e-6)
    assert r[4].item() - d[4].item() == pytest.approx(0.25, abs=1e-6)


def test_rloo_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="at least two"):
        rloo(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def test_whiten_by_hand():
    # (v - 2) / (1 + 0) and (v - 2) / (0.5 + 0.5)
    v = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(whiten(v, 2.0, 1.0, eps=0.0), torch.tensor([-1.0, 0.0, 1.0]))
    assert torch.allclose(whiten(v, 2.0, 0.5, eps=0.5), torch.tensor([-1.0, 0.0, 1.0]))
    assert torch.allclose(whiten(v, 0.0, 1.0, eps=1.0), torch.tensor([0.5, 1.0, 1.5]))


def test_reinforce_pp_batch_normalized_by_hand():
    # rewards 2, 0, 1, 3: mean 1.5, deviations .5, -1.5, -.5, 1.5, population var (.25 + 2.25 + .25 + 2.25) / 4
    # = 1.25, std 1.118034 -> .447214, -1.341641, -.447214, 1.341641
    adv = reinforce_pp(torch.tensor([2.0, 0.0, 1.0, 3.0]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.447214, -1.341641, -0.447214, 1.341641]), atol=1e-6)


def test_reinforce_pp_baseline_by_hand():
    # groups (2, 0) and (1, 3): group means 1 and 2 -> centred 1, -1, -1, 1; batch mean 0, std 1 -> unchanged
    adv = reinforce_pp(torch.tensor([2.0, 0.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)
    # the baseline matters: without it sample 2 (reward 1) is -0.447, with it -1
    plain = reinforce_pp(torch.tensor([2.0, 0.0, 1.0, 3.0]), eps=0.0)
    assert (plain[2] - adv[2]).item() == pytest.approx(1 - 0.447214, abs=1e-6)


def test_estimator_names_and_normalizes_batch():
    assert [AdvantageEstimator(n).normalizes_batch for n in ("grpo", "dr_grpo", "rloo", "reinforce_pp")] == [
        False, False, False, True,
    ]
    with pytest.raises(ValueError, match="'ppo_gae'"):
        AdvantageEstimator("ppo_gae")


@pytest.mark.parametrize("name, full", [("grpo", grpo), ("dr_grpo", dr_grpo), ("rloo", rloo)])
def test_group_stage_group_by_group_equals_full_estimator_and_batch_stage_is_identity(name, full):
    # groups finish one at a time: the group stage sees only its own group's rewards
    est = AdvantageEstimator(name, eps=1e-6)
    staged = torch.empty(len(REWARDS))
    for k in (0, 1, 2):
        members = GROUPS == k
        staged[members] = est.group_stage(REWARDS[members], GROUPS[members])
    kwargs = {"eps": 1e-6} if name == "grpo" else {}
    assert torch.allclose(staged, full(REWARDS, GROUPS, **kwargs), atol=1e-7)
    # the batch stage leaves them alone whatever statistics it is handed
    assert torch.equal(est.batch_stage(staged, 123.0, 0.001), staged)


def test_reinforce_pp_two_stages_across_ranks_equal_the_full_estimator():
    # rank 0 holds group 0 (rewards 2, 0), rank 1 group 1 (1, 3). Group stage: 1, -1 and -1, 1.
    # All-reduced: sum 0, sum of squares 4, count 4 -> mean 0, population std 1. Batch stage: / (1 + eps).
    est = AdvantageEstimator("reinforce_pp", eps=1e-6)
    rank0 = est.group_stage(torch.tensor([2.0, 0.0]), torch.tensor([0, 0]))
    rank1 = est.group_stage(torch.tensor([1.0, 3.0]), torch.tensor([1, 1]))
    assert rank0.tolist() == [1.0, -1.0] and rank1.tolist() == [-1.0, 1.0]
    count = 4
    mean = (rank0.sum() + rank1.sum()).item() / count
    std = math.sqrt(((rank0**2).sum() + (rank1**2).sum()).item() / count - mean**2)
    assert (mean, std) == (0.0, 1.0)
    staged = torch.cat([est.batch_stage(rank0, mean, std), est.batch_stage(rank1, mean, std)])
    full = reinforce_pp(torch.tensor([2.0, 0.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1]), eps=1e-6)
    assert torch.allclose(staged, full, atol=1e-7)
    assert torch.allclose(staged, torch.tensor([1.0, -1.0, -1.0, 1.0]) / (1 + 1e-6), atol=1e-7)


def test_reinforce_pp_without_group_baseline_passes_raw_rewards():
    est = AdvantageEstimator("reinforce_pp", group_baseline=False, eps=0.0)
    raw = est.group_stage(torch.tensor([2.0, 0.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1]))
    assert raw.tolist() == [2.0, 0.0, 1.0, 3.0]
    # batch mean 1.5, std 1.118034 (by hand above)
    out = est.batch_stage(raw, 1.5, math.sqrt(1.25))
    assert torch.allclose(out, torch.tensor([0.447214, -1.341641, -0.447214, 1.341641]), atol=1e-6)
