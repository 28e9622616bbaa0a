"""Data and control planes between rollout ranks and trainer ranks (see transport.py for the protocol)."""

from reflow.dataplane.transport import ControlChannel, Inbox, Message, Outbox, Planes, open_planes

__all__ = ["ControlChannel", "Inbox", "Message", "Outbox", "Planes", "open_planes"]
