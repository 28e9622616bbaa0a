"""``Runs``: a list of ints stored as runs of equal values.

A simulated request's token ids are all 0 and its per-token versions change only at weight syncs, so the
simulator keeps both as runs instead of one list element per token: a 128-GPU comparison generates about
10^8 tokens, which as lists are gigabytes of pointers, grown a macro-step at a time (the reallocations and
page faults were most of the engine's step). The live roles read a request's ``output_ids`` and
``versions`` as lists (their length, the first and last version, iteration), and a ``Runs`` reads the same.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Iterator


class Runs:
    __slots__ = ("values", "ends")

    def __init__(self, items: Iterable[int] = ()):
        self.values: list[int] = []
        self.ends: list[int] = []
        """``ends[k]``: one past the last index of run ``k`` (the runs' cumulative lengths)."""
        self.extend(items)

    def grow(self, value: int, count: int) -> None:
        """Append ``count`` copies of ``value``."""
        if count <= 0:
            return
        end = self.ends[-1] if self.ends else 0
        if self.values and self.values[-1] == value:
            self.ends[-1] = end + count
        else:
            self.values.append(value)
            self.ends.append(end + count)

    def extend(self, items: Iterable[int]) -> None:
        if isinstance(items, Runs):
            start = 0
            for value, end in zip(items.values, items.ends):
                self.grow(value, end - start)
                start = end
            return
        for value in items:
            self.grow(value, 1)

    def __iadd__(self, items: Iterable[int]) -> "Runs":
        self.extend(items)
        return self

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __bool__(self) -> bool:
        return bool(self.ends)

    def __getitem__(self, index):
        if index == 0 or index == -1:  # the first and last versions: read per sample at every readiness check
            if not self.values:
                raise IndexError("Runs index out of range")
            return self.values[index]
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("Runs index out of range")
        return self.values[bisect_right(self.ends, index)]

    def __iter__(self) -> Iterator[int]:
        start = 0
        for value, end in zip(self.values, self.ends):
            for _ in range(end - start):
                yield value
            start = end

    def __eq__(self, other) -> bool:
        if isinstance(other, Runs):
            return self.values == other.values and self.ends == other.ends
        try:
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        except TypeError:
            return NotImplemented

    def __repr__(self) -> str:
        start, parts = 0, []
        for value, end in zip(self.values, self.ends):
            parts.append(f"{value}x{end - start}")
            start = end
        return f"Runs({', '.join(parts)})"
