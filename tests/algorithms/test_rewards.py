"""The reward mix (``reflow.rewards``) with a real chain_sum task, against numbers worked out by hand: a
weighted sum of the task's reward functions ('task', 'answer', 'steps', 'format'), each part kept before its
weight, plus DAPO's overlong shaping (overlong_penalty x R_length of the model-token count) as a part of its
own; weights default to 1 each, and a function the task does not offer is a ValueError that names it."""

from types import SimpleNamespace

import pytest

from reflow.rewards import RewardMix, available_functions
from reflow.tasks.base import Problem
from reflow.tasks.chain_sum import ChainSumTask

TASK = ChainSumTask()
PROBLEM = Problem(uid="p", prompt="3+5+2=", answer="8,10")  # running sums 8, 10


def _section(functions, weights=(), overlong_buffer=0, overlong_penalty=1.0):
    return SimpleNamespace(
        functions=list(functions), weights=list(weights), overlong_buffer=overlong_buffer, overlong_penalty=overlong_penalty
    )


def test_available_functions():
    assert sorted(available_functions(TASK)) == ["answer", "format", "steps", "task"]


@pytest.mark.parametrize(
    "response, parts",
    [
        # all right: task 1, answer 1, steps 2/2, format 1
        ("8,10", {"task": 1.0, "answer": 1.0, "steps": 1.0, "format": 1.0}),
        # a wrong step, right answer: task 0.5, answer 1, steps 1/2, format 1
        ("7,10", {"task": 0.5, "answer": 1.0, "steps": 0.5, "format": 1.0}),
        # right step, wrong answer: task 0, answer 0, steps 1/2, format 1
        ("8,11", {"task": 0.0, "answer": 0.0, "steps": 0.5, "format": 1.0}),
        # an extra number: task 0 (last is 12), answer 0, steps 2 / max(2, 3) = 2/3, format 1
        ("8,10,12", {"task": 0.0, "answer": 0.0, "steps": 2 / 3, "format": 1.0}),
        # prose: nothing, format 0
        ("the sum is 10", {"task": 0.0, "answer": 0.0, "steps": 0.0, "format": 0.0}),
    ],
)
def test_parts_by_hand_with_default_weights(response, parts):
    mix = RewardMix.build(TASK, _section(["task", "answer", "steps", "format"]), max_tokens=10)
    assert mix.weights == {"task": 1.0, "answer": 1.0, "steps": 1.0, "format": 1.0}
    total, got = mix.score(PROBLEM, response, response_tokens=3)
    assert got == pytest.approx(parts)
    assert total == pytest.approx(sum(parts.values()))
    assert mix.part_names == ["task", "answer", "steps", "format"]


def test_weighted_sum_by_hand():
    # "7,10": answer 1, steps 0.5, format 1 -> 0.6 x 1 + 0.3 x 0.5 + 0.1 x 1 = 0.85; parts before their weights
    mix = RewardMix.build(TASK, _section(["answer", "steps", "format"], [0.6, 0.3, 0.1]), max_tokens=10)
    total, parts = mix.score(PROBLEM, "7,10", response_tokens=3)
    assert total == pytest.approx(0.85)
    assert parts == pytest.approx({"answer": 1.0, "steps": 0.5, "format": 1.0})


def test_overlong_shaping_by_hand():
    # cap 10, buffer 4, penalty 0.5: 8 model tokens -> R = (6 - 8) / 4 = -0.5 -> part 0.5 x -0.5 = -0.25;
    # "8,10" with answer at weight 2 -> 2 x 1 - 0.25 = 1.75. At the cap: 2 - 0.5 = 1.5. Short: 2.
    mix = RewardMix.build(TASK, _section(["answer"], [2.0], overlong_buffer=4, overlong_penalty=0.5), max_tokens=10)
    assert mix.part_names == ["answer", "overlong"]
    total, parts = mix.score(PROBLEM, "8,10", response_tokens=8)
    assert total == pytest.approx(1.75)
    assert parts == pytest.approx({"answer": 1.0, "overlong": -0.25})
    assert mix.score(PROBLEM, "8,10", response_tokens=10)[0] == pytest.approx(1.5)
    total, parts = mix.score(PROBLEM, "8,10", response_tokens=6)
    assert total == pytest.approx(2.0) and parts["overlong"] == 0.0


def test_no_buffer_no_overlong_part():
    mix = RewardMix.build(TASK, _section(["task"]), max_tokens=10)
    total, parts = mix.score(PROBLEM, "8,10", response_tokens=50)
    assert total == 1.0 and parts == {"task": 1.0}
    assert mix.part_names == ["task"]


def test_unknown_function_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'brevity'") as err:
        RewardMix.build(TASK, _section(["answer", "brevity"]), max_tokens=10)
    assert "'answer'" not in str(err.value).split("not offered")[0]  # only the unknown one is named as unknown
    assert "chain_sum" in str(err.value)
