"""``Runs`` reads as the list of ints it stands for."""

import random

import pytest

from reflow.sim.runs import Runs


def test_runs_read_as_the_list_they_stand_for():
    rng = random.Random(0)
    for _ in range(50):
        runs, plain = Runs(), []
        for _ in range(rng.randint(0, 8)):
            value, count = rng.randint(0, 3), rng.randint(0, 5)
            runs.grow(value, count)
            plain += [value] * count
        assert len(runs) == len(plain) and bool(runs) == bool(plain) and list(runs) == plain and runs == plain
        for index in range(-len(plain), len(plain)):
            assert runs[index] == plain[index]
        assert runs[1:-1] == plain[1:-1] and runs[::2] == plain[::2]
        copy = Runs(plain)
        copy += runs
        assert list(copy) == plain + plain and copy == Runs(plain + plain)
    with pytest.raises(IndexError):
        Runs()[0]
    assert repr(Runs([3, 3, 4])) == "Runs(3x2, 4x1)" and len(Runs([3, 3, 4]).values) == 2
