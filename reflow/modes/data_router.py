"""Where a rank's data-plane messages go: to the roles it holds now.

Every rank of a decoupled run receives on one data inbox (``reflow.dataplane``), whatever its role: its
role may change at a placement change. The router hands each message to its owner:

  GroupDone, Moved, Handover   the rank's trainer shard (a rank that only generates receives none: an error)
  WorkerStats, EvalShare       the leader (trainer rank 0's second role)
  Flush                        the placement change in progress (``flushed``: who has flushed)

and waits for the two things the protocol waits on at the plane: every sample another shard is moving to this
one (before a step's checkpoint and a placement change), and END from every other rank (at shutdown).
"""

from __future__ import annotations

import time

from reflow.dataplane import Inbox
from reflow.dataplane.transport import DATA
from reflow.modes.leader import Leader
from reflow.modes.trainer_shard import TrainerShard
from reflow.types import EvalShare, Flush, GroupDone, Handover, Moved, WorkerStats

POLL_S = 0.002


class DataRouter:
    def __init__(self, inbox: Inbox, rank: int, leader: Leader | None):
        self.inbox = inbox
        self.rank = rank
        self.leader = leader
        self.shard: TrainerShard | None = None
        """This rank's trainer shard in the current placement (None while it only generates)."""
        self.flushed: set[int] = set()
        """Rollout workers whose FLUSH arrived (a placement change clears it once all have)."""

    def receive(self, version: int) -> None:
        """Hand every message that arrived to its owner; ``version``: the policy version now (a group that
        arrives past its bound is retired at once)."""
        for message in self.inbox.drain():
            if message.kind != DATA:
                continue
            body = message.body
            if isinstance(body, (GroupDone, Moved, Handover)) and self.shard is None:
                raise RuntimeError(f"rank {self.rank} generates but received samples from rank {message.src}")
            if isinstance(body, GroupDone):
                self.shard.accept_group(body.samples, version)
            elif isinstance(body, Moved):
                self.shard.accept_moved(body.samples)
            elif isinstance(body, Handover):
                self.shard.accept_handover(body.samples, body.draws)
            elif isinstance(body, WorkerStats):
                self.leader.receive_stats(message.src, body)
            elif isinstance(body, EvalShare):
                self.leader.evaluations.add(body)
            elif isinstance(body, Flush):
                self.flushed.add(message.src)
            else:
                raise TypeError(f"rank {self.rank}: unknown data-plane message {body!r} from rank {message.src}")

    def settle_moves(self, version: int) -> None:
        """Receive until every sample other shards are moving to this one has arrived."""
        while self.shard is not None and self.shard.awaiting_moved:
            self.receive(version)
            time.sleep(POLL_S)

    def drain_flushes(self, rollout_workers: list[int], version: int) -> None:
        """A placement change's step 1 on a trainer rank: receive until FLUSH came from every rollout worker (so
        every sample addressed to this shard is here) and every move has arrived."""
        while not set(rollout_workers) <= self.flushed:
            self.receive(version)
            time.sleep(POLL_S)
        self.flushed.clear()
        self.settle_moves(version)

    def drain_to_end(self, version: int) -> None:
        """At shutdown, after this rank sent END to every other: receive until END came from every other rank."""
        while not self.inbox.done:
            self.receive(version)
            time.sleep(POLL_S)
        self.receive(version)
        self.inbox.join()
