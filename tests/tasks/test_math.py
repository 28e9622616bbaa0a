"""The math task's reward: math-verify equivalence of the completion's answer and the reference, out of process
under a hard timeout, so a pathological expression costs the timeout and a 0, never a stalled worker."""

import time

import pytest

from reflow.config.job_config import TaskSection
from reflow.tasks import build_task
from reflow.tasks.base import Problem
from reflow.tasks.math_verify_reward import MathVerifier


@pytest.fixture(scope="module")
def task():
    task = build_task(TaskSection(name="math", reward_timeout_s=3.0))
    yield task
    task.verifier.close()


@pytest.mark.parametrize(
    "completion,reference,reward",
    [
        ("Adding the halves... so the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),  # a reference solution
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("We get $x = 2\\sqrt{2}$, i.e. \\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
        ("\\boxed{3}", "4", 0.0),  # a wrong one
        ("I am not sure.", "4", 0.0),  # no answer at all
        ("\\boxed{", "4", 0.0),  # malformed LaTeX
    ],
)
def test_reference_answers_score_one_and_wrong_ones_zero(task, completion, reference, reward):
    assert task.reward(Problem("p", "What is it?", reference), completion) == reward


def test_a_pathological_expression_costs_the_timeout_and_a_zero(task):
    problem = Problem("p", "What is it?", "3")
    before = task.verifier.timeouts
    start = time.time()
    assert task.reward(problem, "\\boxed{9^{9^{9^{9^{9}}}}}") == 0.0  # SymPy would compute this for ever
    assert time.time() - start < 3.0 + 2.0
    assert task.verifier.timeouts == before + 1
    assert task.reward(problem, "\\boxed{3}") == 1.0  # a new child serves the next call


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        MathVerifier(0)
