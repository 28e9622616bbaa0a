"""Every loss aggregation gives one update the same gradient whether the batch is served whole, by one rank
in one micro-batch, or split over two FSDP ranks in micro-batches (``scripts/aggregation_equivalence.py``).

Tolerance: the two arrangements sum the same float32 terms in a different order (micro-batch accumulation,
the all-reduce), so they agree to float32 rounding of the sums: measured, gradient elements within 6.3e-7 of
the largest and the norm and loss within 3e-7 relative; 1e-5 leaves a margin of 15, while a denominator
taken per micro-batch or per rank moves the gradient by tens of percent."""

import json

import pytest

from tests.conftest import run_torchrun


def test_micro_batches_and_ranks_give_the_big_batch_gradient(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(2, ["tests/trainer/scripts/aggregation_equivalence.py", str(out)], timeout=400)  # a hang ends
    report = json.loads(out.read_text())
    uneven = {case: report.pop(case) for case in ("uneven/one_minibatch", "uneven/two_minibatches", "uneven/token_budget")}
    assert set(report) == {
        "token_mean/ppo_clip", "seq_mean_token_mean/ppo_clip", "seq_mean_token_sum/ppo_clip", "token_sum_norm/ppo_clip",
        "seq_mean_token_mean/gspo", "token_sum_norm/cispo",
        "token_mean/ppo_clip/kl_reward+token_mask+entropy", "seq_mean_token_mean/dual_clip/kl_k2_loss+sequence_tis+warmup",
    }
    for case, figures in report.items():
        whole, split = figures["grad_norm"]
        assert whole > 1e-3, case  # the gradient is not trivially zero
        assert split == pytest.approx(whole, rel=1e-5), case
        assert figures["loss"][1] == pytest.approx(figures["loss"][0], rel=1e-5, abs=1e-7), case
        # every gradient element, to float32 rounding of the largest
        assert figures["grad_max_diff"] <= 1e-5 * figures["grad_max_abs"], case
    masked = report["token_mean/ppo_clip/kl_reward+token_mask+entropy"]
    assert 0 < masked["dropped"][0] == masked["dropped"][1] < 1  # the band dropped some tokens, alike
    assert masked["entropy"] > 0 and masked["kl"] == 0.0  # the reference is the starting policy: no KL yet
    warm = report["seq_mean_token_mean/dual_clip/kl_k2_loss+sequence_tis+warmup"]
    assert warm["lr"] == [5e-4, 5e-4]  # update 0 of a 2-update warmup: lr / 2
    assert report["token_mean/ppo_clip"]["lr"] == [1e-3, 1e-3]
    # the aggregations are different losses: their gradients differ
    norms = {case: figures["grad_norm"][0] for case, figures in report.items()}
    assert norms["token_mean/ppo_clip"] != pytest.approx(norms["seq_mean_token_mean/ppo_clip"], rel=1e-2)
    assert norms["seq_mean_token_sum/ppo_clip"] != pytest.approx(norms["token_sum_norm/ppo_clip"], rel=1e-2)
    # ranks with unequal micro-batch counts (sync mode's dynamic sampling keeps groups unevenly): the run
    # finishes (the padding passes are agreed before the first real one) and gives the same updates
    for case, figures in uneven.items():
        assert figures["grad_norm"][0] > 1e-3, case
        assert figures["grad_norm"][1] == pytest.approx(figures["grad_norm"][0], rel=1e-5), case
        assert figures["loss"][1] == pytest.approx(figures["loss"][0], rel=1e-5, abs=1e-7), case
        assert figures["grad_max_diff"] <= 1e-5 * figures["grad_max_abs"], case
        assert figures["dropped"][0] == figures["dropped"][1], case
    assert uneven["uneven/two_minibatches"]["updates"] == [2, 2]
    # a token budget cut rank 0's rows into several passes (the long ones two a pass), rank 1's into one
    passes = uneven["uneven/token_budget"]["passes"]
    assert passes[0] >= 3 and passes[1] >= 1 and passes[0] != passes[1], passes
