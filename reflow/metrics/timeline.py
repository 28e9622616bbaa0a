"""What each rank did, when: a timeline of spans (generate, idle, sync, evaluate, train, wait, transition) that
Chrome's trace viewer and Perfetto draw, one row per rank.

    python -m reflow.metrics.timeline outputs/tiny_elastic            # writes outputs/tiny_elastic/trace.json

Each rank appends its spans to ``<dump_folder>/timeline/rank<N>.jsonl`` (Chrome "complete" events: name, start
and duration in microseconds of wall-clock time, the rank as the process); the command merges the files into
one ``trace.json`` with each rank named by the roles it had. Consecutive spans of one name closer than
``MERGE_GAP_S`` are one span (a rollout rank's thousands of engine steps draw as bands of "generate" between
its syncs and idle waits). Writing costs a buffered line per span; ``metrics.timeline = false`` turns it off.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time

MERGE_GAP_S = 0.002
"""Spans of one name this close are drawn as one."""
FLUSH_EVERY = 256
"""Spans buffered before a write."""


class Timeline:
    """One rank's spans. ``span(name)`` times a block; ``add(name, start, end)`` records one timed elsewhere."""

    def __init__(self, dump_folder: str, rank: int, role: str, clock=time.time):
        folder = os.path.join(dump_folder, "timeline")
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank{rank}.jsonl")
        self.rank, self.clock = rank, clock
        self.pending: list[dict] = []
        self.open: dict | None = None
        """The latest span, kept open for a same-name span that follows within ``MERGE_GAP_S``."""
        self._file = open(self.path, "a", encoding="utf-8")
        self._write({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} ({role})"}})

    @contextlib.contextmanager
    def span(self, name: str, **args):
        start = self.clock()
        try:
            yield
        finally:
            self.add(name, start, self.clock(), **args)

    def add(self, name: str, start: float, end: float, **args) -> None:
        last = self.open
        if last is not None and last["name"] == name and not args and start - last["end"] <= MERGE_GAP_S:
            last["end"] = max(last["end"], end)
            return
        self._close_open()
        self.open = {"name": name, "start": start, "end": end, "args": args}

    def role(self, role: str) -> None:
        """The rank's role from now on (a placement change), as an instant event on its row."""
        self._close_open()
        self.pending.append({"name": f"role: {role}", "ph": "i", "s": "p", "ts": _us(self.clock()), "pid": self.rank, "tid": 0})

    def _close_open(self) -> None:
        if self.open is None:
            return
        span, self.open = self.open, None
        event = {"name": span["name"], "ph": "X", "ts": _us(span["start"]), "dur": max(_us(span["end"] - span["start"]), 1),
                 "pid": self.rank, "tid": 0}
        if span["args"]:
            event["args"] = span["args"]
        self.pending.append(event)
        if len(self.pending) >= FLUSH_EVERY:
            self.flush()

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event) + "\n")

    def flush(self) -> None:
        for event in self.pending:
            self._write(event)
        self.pending = []
        self._file.flush()

    def close(self) -> None:
        self._close_open()
        self.flush()
        self._file.close()


class NullTimeline:
    """A timeline that records nothing (the simulator, other tools, ``metrics.timeline = false``)."""

    @contextlib.contextmanager
    def span(self, name: str, **args):
        yield

    def add(self, name: str, start: float, end: float, **args) -> None:
        pass

    def role(self, role: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _us(seconds: float) -> int:
    return int(round(seconds * 1e6))


def merge(dump_folder: str, out: str | None = None) -> str:
    """Every rank's timeline in one Chrome trace (``{"traceEvents": [...]}``), times from the earliest span."""
    files = sorted(glob.glob(os.path.join(dump_folder, "timeline", "rank*.jsonl")))
    if not files:
        raise FileNotFoundError(f"{dump_folder}: no timeline/rank*.jsonl (metrics.timeline writes them during a run)")
    events = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            events += [json.loads(line) for line in f if line.strip()]
    timed = [event["ts"] for event in events if "ts" in event]
    origin = min(timed) if timed else 0
    names: dict[int, str] = {}
    for event in events:
        if "ts" in event:
            event["ts"] -= origin
        if event.get("ph") == "M":  # a resumed run adds a name line per start: keep the last
            names[event["pid"]] = event["args"]["name"]
    merged = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}} for pid, name in sorted(names.items())
    ]
    merged += sorted((event for event in events if event.get("ph") != "M"), key=lambda event: (event["ts"], event["pid"]))
    out = out or os.path.join(dump_folder, "trace.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0] + "\n\nusage: python -m reflow.metrics.timeline DUMP_FOLDER [OUT]")
        return 0 if argv else 2
    try:
        out = merge(argv[0], argv[1] if len(argv) > 1 else None)
    except FileNotFoundError as error:
        print(f"reflow.metrics.timeline: {error}", file=sys.stderr)
        return 2
    print(f"reflow.metrics.timeline: wrote {out} (open it in chrome://tracing or ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
