"""Rollout tensor parallelism: one vLLM engine over an aligned block of s_R ranks.

vLLM's ``external_launcher`` executor runs one engine process per rank of the block; each holds 1/s_R of
the weights and a full copy of the scheduler, and the forward passes meet in the block's all-reduces. The
copies stay in step only if every rank makes the same engine calls in the same order. So the block's first
rank is the rollout worker (dispatch budget, turn driver, control commands, data plane: everything a
rollout rank does), and the other ranks, the followers, replay its engine calls:

    leader    every call that changes the engine (``add``, ``hold_all``) is recorded; ``step`` first
              broadcasts the calls recorded since the last broadcast, then steps; a weight sync and the
              end of the worker's run (Stop, Transition) are broadcast the same way, just before they happen
    follower  receive a list of calls, make them on its own engine, in order: ``add`` and ``hold_all`` with
              the same requests (the engine ids match: both count submissions the same), ``step`` (its
              outputs are the leader's, and are dropped), ``sync`` joins the weight sync, ``leave`` returns
              the command the leader left with

Who waits for whom, and why it cannot deadlock: a follower only ever waits on the leader's next broadcast
(over the block's own gloo group, without a timeout: an idle leader is normal, and a leader that dies
takes the job down through torchrun), and the leader waits for the followers only inside collectives that the
followers join at the same point of the same call sequence: vLLM's all-reduces inside a step (the follower
receives the step before making it), and the weight sync (the follower receives ``sync`` before the leader
enters it). The leader broadcasts before each of them, so neither can be entered by one side alone; and it
broadcasts ``leave`` before returning from its run, so a follower never waits on a leader that stopped.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

if TYPE_CHECKING:
    from reflow.rollout.request import Request


class EngineMirror:
    """The broadcast of engine calls from a block's leader to its followers."""

    def __init__(self, group, leader: int, rank: int):
        self.group, self.leader = group, leader
        self.is_leader = rank == leader
        self.pending: list[tuple] = []

    def record_add(self, req: "Request") -> None:
        # what the follower's engine needs to submit the same request (the leader's copy changes as it generates)
        self.pending.append(("add", dataclasses.replace(
            req, meta={}, output_ids=list(req.output_ids), logprobs=[], versions=[], model_spans=[],
        )))

    def record_abort(self, request_id: str) -> None:
        self.pending.append(("abort", request_id))

    def record_hold_all(self) -> None:
        self.pending.append(("hold_all",))

    def publish(self, *call: Any) -> None:
        """Leader: broadcast the recorded calls, then ``call`` (``("step",)``, ``("sync", v)``, ``("leave", c)``)."""
        calls, self.pending = self.pending + [call], []
        dist.broadcast_object_list([calls], src=self.leader, group=self.group)

    def receive(self) -> list[tuple]:
        box: list = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]


def engine_mirror(world_size: int, rollout_tp: int, rank: int) -> EngineMirror | None:
    """With rollout tensor parallelism: the broadcast from ``rank``'s engine block leader to the block (every
    block's gloo group is made here by every rank, in the same order: new_group is collective)."""
    if rollout_tp == 1:
        return None
    mine = None
    for first in range(0, world_size, rollout_tp):
        block = list(range(first, first + rollout_tp))
        # a follower waits on its leader's next call for as long as the leader is idle (a long train step, a
        # checkpoint): no collective timeout there; a leader that dies ends the job through torchrun
        group = dist.new_group(ranks=block, backend="gloo", timeout=datetime.timedelta(days=365))
        if rank in block:
            mine = EngineMirror(group, first, rank)
    return mine


class ReplayedEngine(Protocol):
    """What a follower replays its leader's calls on (its ``RolloutEngine``)."""

    def add(self, req: "Request") -> None: ...

    def hold_all(self) -> list: ...

    def abort(self, request_id: str): ...

    def step(self) -> list: ...


def follow(engine: ReplayedEngine, mirror: EngineMirror, weight_sync) -> Any:
    """A follower's run: replay the leader's engine calls until it leaves; returns the command it left with."""
    while True:
        for call in mirror.receive():
            kind = call[0]
            if kind == "add":
                engine.add(call[1])
            elif kind == "hold_all":
                engine.hold_all()
            elif kind == "abort":
                engine.abort(call[1])
            elif kind == "step":
                engine.step()
            elif kind == "sync":
                weight_sync.sync(None, engine, call[1])
            elif kind == "leave":
                return call[1]
            else:
                raise RuntimeError(f"unknown engine call from the leader of this engine: {call!r}")
