import json

import pytest

from reflow.config.job_config import TaskSection
from reflow.tasks import TASKS, build_task, load_problems
from reflow.tasks.base import Problem, Task, iterate_epochs
from reflow.tasks.chain_sum import ChainSumSpec, generate, write_jsonl


def test_reward_levels():
    task = build_task(TaskSection(name="chain_sum"))
    assert isinstance(task, Task)
    p = Problem("x", "3+5+2+8=", "8,10,18")
    assert task.reward(p, "8,10,18") == 1.0
    assert task.reward(p, " 8,10,18 ") == 1.0
    assert task.reward(p, "8,11,18") == 0.5  # right answer, wrong work
    assert task.reward(p, "8,10,19") == 0.0
    assert task.reward(p, "") == 0.0
    assert task.reward(p, "8,10,") == 0.0
    assert task.reward(p, "eighteen") == 0.0


def test_generated_answers_are_running_sums():
    for p in generate(200, seed=3):
        terms = [int(t) for t in p.prompt.rstrip("=").split("+")]
        sums = [sum(terms[: k + 1]) for k in range(1, len(terms))]
        assert p.answer == ",".join(map(str, sums))


def test_length_has_a_long_tail():
    lens = sorted(len(p.answer) for p in generate(2000, seed=0, spec=ChainSumSpec()))
    median, p95 = lens[len(lens) // 2], lens[int(0.95 * len(lens))]
    assert lens[0] <= 2 and p95 >= 2.5 * median


def test_generation_is_deterministic(tmp_path):
    a, b = generate(50, seed=7), generate(50, seed=7)
    assert a == b
    path = tmp_path / "d.jsonl"
    write_jsonl(a, str(path))
    assert load_problems(str(path)) == a


def test_bad_rows_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": 1, "prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"id": 2}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_problems(str(path))
    with pytest.raises(ValueError, match="not found"):
        load_problems(str(tmp_path / "none.jsonl"))


def test_unknown_task():
    with pytest.raises(ValueError, match="task.name"):
        build_task(TaskSection(name="nope"))
    assert "chain_sum" in TASKS


def test_epoch_stream_covers_everything_once_per_epoch():
    probs = generate(10, seed=1)
    it = iterate_epochs(probs, seed=0)
    first = [next(it) for _ in range(10)]
    assert sorted(p.uid for p in first) == sorted(p.uid for p in probs)
