"""The shared prompt stream: no draw index skipped or drawn twice, however the rollout pool changes."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.modes.prompts import PromptStream, initial_shares, reassign
from reflow.tasks.base import Problem, iterate_epochs


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    pools=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    first_draw=st.sampled_from([0, 37]),
)
def test_pool_changes_never_skip_or_repeat_a_draw(seed, pools, first_draw):
    rng = random.Random(seed)
    shares = initial_shares(pools[0], first_draw)
    drawn = []
    for count in pools[1:] + [None]:
        for _ in range(rng.randrange(0, 30)):  # rollout ranks draw at their own pace
            drawn.append(shares[rng.randrange(len(shares))].take())
        if count is not None:
            shares = reassign(shares, count)
    # drain: every index below the furthest one drawn is drawn exactly once
    frontier = max(drawn, default=first_draw - 1) + 1
    while True:
        nxt = [s for s in shares if s.pending or s.start < frontier]
        if not nxt:
            break
        drawn.append(nxt[0].take())
    drawn = [d for d in drawn if d < frontier]
    assert sorted(drawn) == list(range(first_draw, frontier))


def test_random_access_matches_the_sequential_stream():
    problems = [Problem(uid=f"p{i}", prompt=str(i), answer=str(i)) for i in range(7)]
    sequential = iterate_epochs(problems, seed=3)
    stream = PromptStream(problems, seed=3)
    assert [next(sequential).uid for _ in range(30)] == [stream.problem_at(d).uid for d in range(30)]
