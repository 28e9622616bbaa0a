"""DAPO's reward shaping and sample filter (``reflow.algorithms.shaping``) and the learning-rate schedule
(``reflow.algorithms.schedules``) against numbers worked out by hand: the soft overlong penalty is 0 up to
L - buffer, linear inside the buffer, -1 at and past the cap and off with no buffer; dynamic sampling keeps a
group only when its rewards are not all equal; the schedule warms up linearly over W updates, then stays
constant or decays linearly or by a cosine to min_ratio at the last update, and clamps past it."""

import math

import pytest

from reflow.algorithms.schedules import LRSchedule
from reflow.algorithms.shaping import has_signal, overlong_penalty


@pytest.mark.parametrize(
    "length, expect",
    [
        (0, 0.0),
        (5, 0.0),  # below the free region's end 10 - 4 = 6
        (6, 0.0),  # at it
        (7, -0.25),  # (6 - 7) / 4
        (8, -0.5),  # (6 - 8) / 4
        (9, -0.75),  # (6 - 9) / 4
        (10, -1.0),  # at the cap
        (15, -1.0),  # past it
    ],
)
def test_overlong_penalty_by_hand(length, expect):
    assert overlong_penalty(length, max_tokens=10, buffer=4) == pytest.approx(expect)


def test_overlong_penalty_is_continuous_at_the_cap():
    # one token short of the cap: (6 - 9) / 4 = -0.75 with buffer 4; buffer 1: free 9, length 9 -> 0, 10 -> -1
    assert overlong_penalty(9, 10, 1) == 0.0 and overlong_penalty(10, 10, 1) == -1.0
    # buffer 1000 of cap 1000 (free region 0): length 500 -> -0.5
    assert overlong_penalty(500, 1000, 1000) == pytest.approx(-0.5)


@pytest.mark.parametrize("buffer", [0, -3])
def test_no_buffer_no_penalty(buffer):
    assert overlong_penalty(8, 10, buffer) == 0.0
    assert overlong_penalty(50, 10, buffer) == 0.0


def test_has_signal():
    assert not has_signal([1.0, 1.0, 1.0])  # all correct
    assert not has_signal([0.0, 0.0])  # all wrong
    assert has_signal([1.0, 0.0, 1.0])
    assert has_signal([0.5, 0.5001])
    assert not has_signal([0.5, 0.5 + 1e-12])  # within the tolerance
    assert not has_signal([])
    assert not has_signal([0.3])  # a single sample cannot differ from itself


def test_warmup_by_hand():
    # W = 4: (u + 1) / 4 -> 0.25, 0.5, 0.75, 1.0, then the decay starts at 1
    for decay in ("constant", "linear", "cosine"):
        s = LRSchedule(warmup_updates=4, total_updates=12, decay=decay, min_ratio=0.1)
        assert [s.lr_factor(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0], decay
        assert s.lr_factor(4) == pytest.approx(1.0), decay


def test_constant_after_warmup():
    s = LRSchedule(warmup_updates=4, total_updates=12, decay="constant", min_ratio=0.1)
    assert [s.lr_factor(u) for u in range(4, 30)] == [1.0] * 26


def test_linear_decay_by_hand():
    # W 4, U 12, f 0.1: span 8; p = (u - 4) / 8
    #   u 4 (p 0) 1 ; u 6 (p .25) 1 - .9 x .25 = .775 ; u 8 (p .5) .55 ; u 12 (p 1) .1 ; u 20 clamped .1
    s = LRSchedule(warmup_updates=4, total_updates=12, decay="linear", min_ratio=0.1)
    assert s.lr_factor(4) == pytest.approx(1.0)
    assert s.lr_factor(6) == pytest.approx(0.775)
    assert s.lr_factor(8) == pytest.approx(0.55)
    assert s.lr_factor(12) == pytest.approx(0.1)
    assert s.lr_factor(20) == pytest.approx(0.1)


def test_cosine_decay_by_hand():
    # f + (1 - f)(1 + cos(pi p)) / 2 with f 0.1:
    #   p 0 -> 1 ; p .25 -> .1 + .45 x (1 + .707107) = .868198 ; p .5 -> .1 + .45 = .55 ; p 1 -> .1
    s = LRSchedule(warmup_updates=4, total_updates=12, decay="cosine", min_ratio=0.1)
    assert s.lr_factor(4) == pytest.approx(1.0)
    assert s.lr_factor(6) == pytest.approx(0.868198, abs=1e-6)
    assert s.lr_factor(8) == pytest.approx(0.55)
    assert s.lr_factor(12) == pytest.approx(0.1)
    assert s.lr_factor(100) == pytest.approx(0.1)
    # cosine stays above linear in the first half: .868198 vs .775 at p .25, by .45 cos(pi/4) - .225 = .093198
    lin = LRSchedule(warmup_updates=4, total_updates=12, decay="linear", min_ratio=0.1)
    assert s.lr_factor(6) - lin.lr_factor(6) == pytest.approx(0.45 * math.cos(math.pi / 4) - 0.225)


def test_decay_without_warmup_by_hand():
    # W 0, U 10, f 0: linear 1, .5, 0 at u 0, 5, 10 ; cosine .5 at u 5
    lin = LRSchedule(warmup_updates=0, total_updates=10, decay="linear")
    assert [lin.lr_factor(u) for u in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    cos = LRSchedule(warmup_updates=0, total_updates=10, decay="cosine")
    assert [cos.lr_factor(u) for u in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])


def test_warmup_as_long_as_the_run():
    # U = W = 4: span clamped to 1; after the warmup the decay is at its end at once (p = (4 - 4) / 1 = 0, then 1)
    s = LRSchedule(warmup_updates=4, total_updates=4, decay="linear", min_ratio=0.2)
    assert [s.lr_factor(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_factor(4) == pytest.approx(1.0) and s.lr_factor(5) == pytest.approx(0.2)


def test_unknown_decay_is_refused():
    with pytest.raises(ValueError, match="'step'"):
        LRSchedule(decay="step")
