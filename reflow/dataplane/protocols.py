"""The transport a role needs, as protocols: the gloo planes implement them live (``ControlChannel``,
``Outbox``), the simulator's instant control sink and the tests' in-process fakes otherwise. A role is
written against these, never against a process group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from reflow.types import Command, DataMessage


@runtime_checkable
class CommandSink(Protocol):
    """Where the leader's commands go: one rollout worker each."""

    def send(self, dst: int, command: "Command") -> None: ...


@runtime_checkable
class CommandSource(Protocol):
    """Where a rollout worker's commands come from, in the order sent; ``leader`` is the rank that sends them."""

    leader: int

    def poll(self) -> list["Command"]: ...

    def wait(self, timeout: float | None = None) -> "Command | None": ...


@runtime_checkable
class DataSink(Protocol):
    """Where a role's data-plane messages go (delivered in the order sent per destination)."""

    def put(self, dst: int, body: "DataMessage") -> None: ...
