"""Log-probs without the full-vocabulary tensor: ``chunked_token_logprobs`` equals the whole computation, in
value and in gradient, and a trainer whose head runs in chunks trains as one whose head runs whole."""

import json

import pytest
import torch

from reflow.trainer.logprobs import chunked_token_logprobs, token_logprobs
from tests.conftest import run_torchrun


@pytest.mark.parametrize("chunk", [0, 1, 7, 24, 1000])
def test_chunked_logprobs_equal_the_whole_computation_and_its_gradients(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 8, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 8))
    whole = token_logprobs(head(hidden), targets, temperature=0.7)
    weights = torch.randn(3, 8)
    (whole * weights).sum().backward()
    grads_whole = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    chunked = chunked_token_logprobs(hidden, targets, head, temperature=0.7, chunk_tokens=chunk)
    (chunked * weights).sum().backward()
    # the same float32 operations on the same rows, in another grouping: equal to float rounding
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, grads_whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, grads_whole[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 1, 7, 24])
def test_chunked_entropy_equals_the_whole_softmax_and_trains_only_when_asked(chunk):
    """The entropy from each chunk's logits equals H = logsumexp(z) - sum softmax(z) z of the whole tensor;
    'trained' carries its gradient (an entropy bonus), 'logged' does not."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 8, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 8))
    logits = head(hidden).float() / 0.7
    whole = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    whole.sum().backward()
    grad_whole = hidden.grad.clone()
    hidden.grad = None
    logps, entropy = chunked_token_logprobs(hidden, targets, head, 0.7, chunk, entropy="trained")
    torch.testing.assert_close(logps, token_logprobs(head(hidden), targets, 0.7), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, whole, rtol=1e-6, atol=1e-6)
    entropy.sum().backward()
    torch.testing.assert_close(hidden.grad, grad_whole, rtol=1e-5, atol=1e-6)
    _, logged = chunked_token_logprobs(hidden, targets, head, 0.7, chunk, entropy="logged")
    assert not logged.requires_grad


def test_chunked_logprobs_without_gradients_keep_no_graph():
    head = torch.nn.Linear(4, 10, bias=False)
    with torch.no_grad():
        out = chunked_token_logprobs(torch.randn(2, 5, 4), torch.randint(0, 10, (2, 5)), head, 1.0, chunk_tokens=3)
    assert out.shape == (2, 5) and not out.requires_grad


def test_a_trainer_with_a_chunked_head_trains_as_one_with_a_whole_head(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(2, ["tests/trainer/scripts/chunked_logprobs.py", str(out)])
    for rank in range(2):
        report = json.loads((tmp_path / f"report.json.rank{rank}").read_text())
        # float32 throughout: the chunks change only how the rows are grouped into matrix products
        assert report["logprob_max_diff"] <= 1e-5 * max(report["logprob_scale"], 1.0), report
        assert report["loss"][0] == pytest.approx(report["loss"][1], rel=1e-5, abs=1e-7), report
        assert report["grad_norm"][0] == pytest.approx(report["grad_norm"][1], rel=1e-4), report
        # the update moved the weights, and both heads moved them alike. AdamW's first step moves each weight by
        # about lr whatever its gradient's size, so a gradient's rounding shows up to lr x its relative error:
        # measured 1.1e-6 against a 6.0e-4 step (0.2%); a head whose gradient were wrong would move them apart
        # by the step itself
        assert report["param_max_change"] > 0
        assert report["param_max_diff"] <= 1e-2 * report["param_max_change"], report
