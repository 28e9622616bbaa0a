"""The run's prompt stream, shared by the rollout ranks so that no prompt is skipped or drawn twice, even when
the number of rollout ranks changes.

The stream is a fresh seeded permutation of the problems per epoch (or the file's order, task.shuffle =
false); a prompt's *draw index* is its position in
it, unique in the run. Rollout rank i of R takes the draw indices i, i + R, i + 2R, ... (a ``PromptShare``).
When the rollout pool changes, every old share's undrawn indices below the furthest one any share reached
(its *holes*) are dealt to the new shares first, then each new share continues with its own stride from there
(``reassign``): every index is drawn by exactly one share, once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from reflow.tasks.base import Problem, epoch_order


class PromptStream:
    """Random access to the run's stream: the problem at any draw index."""

    def __init__(self, problems: list[Problem], seed: int, shuffle: bool = True):
        if not problems:
            raise ValueError("the prompt stream needs at least one problem")
        self.problems, self.seed, self.shuffle = problems, seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def problem_at(self, draw: int) -> Problem:
        epoch, position = divmod(draw, len(self.problems))
        if epoch not in self._orders:
            # one epoch at a time: the stream only moves forward
            self._orders = {epoch: epoch_order(len(self.problems), self.seed, epoch, self.shuffle)}
        return self.problems[self._orders[epoch][position]]


@dataclass
class PromptShare:
    """One rollout rank's draw indices: ``pending`` first (holes dealt at a pool change), then ``start``,
    ``start + stride``, ..."""

    start: int
    stride: int
    pending: deque = field(default_factory=deque)

    def peek(self) -> int:
        """The draw index ``take`` returns next."""
        return self.pending[0] if self.pending else self.start

    def take(self) -> int:
        if self.pending:
            return self.pending.popleft()
        draw = self.start
        self.start += self.stride
        return draw


def initial_shares(count: int, first_draw: int = 0, holes: list[int] = ()) -> list[PromptShare]:
    """R shares of a stream that starts (or resumes) at ``first_draw``; a resumed one first deals the ``holes``
    below it (draws admitted but never delivered before the checkpoint) round robin."""
    shares = [PromptShare(start=first_draw + i, stride=count) for i in range(count)]
    for k, draw in enumerate(sorted(holes)):
        shares[k % count].pending.append(draw)
    return shares


def reassign(shares: list[PromptShare], new_count: int) -> list[PromptShare]:
    """New shares for ``new_count`` rollout ranks that together draw exactly what ``shares`` have not."""
    frontier = max(share.start for share in shares)  # no share has drawn anything at or beyond it but its own
    holes = sorted(
        [draw for share in shares for draw in share.pending]
        + [draw for share in shares for draw in range(share.start, frontier, share.stride)]
    )
    new = [PromptShare(start=frontier + i, stride=new_count) for i in range(new_count)]
    for k, draw in enumerate(holes):
        new[k % new_count].pending.append(draw)
    return new
