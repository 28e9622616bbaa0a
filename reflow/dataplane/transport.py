"""Point-to-point messages over torch.distributed (gloo, CPU tensors), off the main thread.

Gloo's point-to-point work objects only complete inside ``wait()``, so polling
``is_completed()`` from a loop does not work. Each plane therefore uses a
dedicated gloo process group driven by one background thread per process:

    Outbox   (sender thread)    takes messages from a queue, sends header + payload with blocking send
    Inbox    (receiver thread)  blocking any-source receive of a header, then the payload from that
                                sender; puts the message on a queue the main loop drains without waiting

A message is a pickled Python object in a uint8 tensor preceded by a 2-long
header (kind, length). Messages from one sender arrive in the order sent.
Shutdown is explicit: each sender finally sends an END message, and an Inbox
stops once it has seen END from every expected sender, so no thread is left
blocked and no message is lost.

Each process group is used by exactly one thread in each process, so these
threads never interleave with the main thread's collectives.
"""

from __future__ import annotations

import pickle
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

END = 0
DATA = 1
CONTROL = 2


@dataclass
class Message:
    kind: int
    src: int
    body: Any


def _encode(obj: Any) -> torch.Tensor:
    raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


class Outbox:
    """Non-blocking sends: ``put`` returns at once; a thread does the sending in order."""

    def __init__(self, group, name: str):
        self.group = group
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"reflow-outbox-{name}", daemon=True)
        self.thread.start()

    def put(self, dst: int, body: Any, kind: int = DATA) -> None:
        if self.error is not None:
            raise RuntimeError(f"outbox thread failed: {self.error!r}") from self.error
        self.q.put((dst, kind, body))

    def _run(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item is None:
                    return
                dst, kind, body = item
                payload = _encode(body)
                header = torch.tensor([kind, payload.numel()], dtype=torch.long)
                dist.send(header, dst, group=self.group)
                dist.send(payload, dst, group=self.group)
        except BaseException as e:  # surfaced on the next put/close
            self.error = e

    @property
    def pending(self) -> int:
        return self.q.qsize()

    def close(self, end_to: list[int]) -> None:
        """Send END to every receiver, then wait for the queue to drain."""
        for dst in end_to:
            self.q.put((dst, END, None))
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"outbox thread failed: {self.error!r}") from self.error


class Inbox:
    """Receives until END arrived from every expected sender; ``drain`` never blocks."""

    def __init__(self, group, senders: list[int], name: str):
        self.group = group
        self.waiting_for = set(senders)
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"reflow-inbox-{name}", daemon=True)
        if self.waiting_for:
            self.thread.start()

    def _run(self) -> None:
        try:
            while self.waiting_for:
                header = torch.zeros(2, dtype=torch.long)
                src = dist.recv(header, src=None, group=self.group)
                kind, n = int(header[0]), int(header[1])
                payload = torch.empty(n, dtype=torch.uint8)
                dist.recv(payload, src=src, group=self.group)
                if kind == END:
                    self.waiting_for.discard(src)
                    self.q.put(Message(END, src, None))
                    continue
                self.q.put(Message(kind, src, _decode(payload)))
        except BaseException as e:
            self.error = e

    def drain(self) -> list[Message]:
        if self.error is not None:
            raise RuntimeError(f"inbox thread failed: {self.error!r}") from self.error
        out = []
        while True:
            try:
                out.append(self.q.get_nowait())
            except queue.Empty:
                return out

    def get(self, timeout: float | None = None) -> Message | None:
        """Block for one message (None on timeout)."""
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            if self.error is not None:
                raise RuntimeError(f"inbox thread failed: {self.error!r}") from self.error
            return None

    @property
    def done(self) -> bool:
        return not self.waiting_for and self.q.empty()

    def join(self) -> None:
        if self.thread.is_alive():
            self.thread.join()


class ControlChannel:
    """Leader -> recipients: commands (any picklable object), in order, over their own process group.

    Every recipient can be sent to; which of them a command goes to is the caller's choice (in a decoupled run,
    the ranks that generate now)."""

    def __init__(self, group, rank: int, leader: int, recipients: list[int]):
        self.rank = rank
        self.leader = leader
        self.recipients = recipients
        self.outbox = Outbox(group, "control") if rank == leader else None
        self.inbox = Inbox(group, [leader], "control") if rank in recipients else None

    def broadcast(self, command: Any, ranks: list[int]) -> None:
        """The same command to each of ``ranks`` (recipients)."""
        for r in ranks:
            self.send(r, command)

    def send(self, rank: int, command: Any) -> None:
        assert self.outbox is not None, "only the leader sends commands"
        self.outbox.put(rank, command, CONTROL)

    def poll(self) -> list[Any]:
        """Commands that arrived (recipients); never blocks."""
        return [m.body for m in self.inbox.drain() if m.kind == CONTROL] if self.inbox else []

    def wait(self, timeout: float | None = None) -> Any | None:
        m = self.inbox.get(timeout)
        while m is not None and m.kind != CONTROL:
            m = self.inbox.get(timeout)
        return m.body if m is not None else None

    def close(self) -> None:
        if self.outbox is not None:
            self.outbox.close(self.recipients)
        if self.inbox is not None:
            self.inbox.join()


@dataclass
class Planes:
    """One rank's ends of the two planes of a decoupled run."""

    control: ControlChannel
    """Commands from rank 0 (which trains in every placement) to any other rank."""
    inbox: Inbox
    """Data from every other rank: any rank may train or generate over the run, so any may send."""
    outbox: Outbox


def open_planes(rank: int, world_size: int) -> Planes:
    """Every rank, at the same point (``new_group`` is collective): a gloo group per plane and its threads."""
    data_group = dist.new_group(backend="gloo")
    control_group = dist.new_group(backend="gloo")
    others = [r for r in range(world_size) if r != rank]
    return Planes(
        ControlChannel(control_group, rank, 0, [r for r in range(world_size) if r != 0]),
        Inbox(data_group, others, "data"),
        Outbox(data_group, "data"),
    )
