"""Who decides the placement: the interface a placement controller implements, and the forced schedule.

At every weight-sync point trainer rank 0 asks the run's controller whether to change the placement; the
answer is broadcast to the trainer ranks and, when it is a change, the run performs it at once
(docs/decoupled_protocol.md). A controller is plain Python: measurements in, a decision out. Two exist:
``ForcedSchedule`` (placement.schedule) and ``reflow.scheduler.planner.PlacementPlanner``
(scheduler.adaptive_placement).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from reflow.scheduler.planner import PlacementDecision, PlacementPlanner, PlannerSettings


@runtime_checkable
class PlacementController(Protocol):
    def decide(self, step: int, replicas: int, window: list[dict]) -> PlacementDecision:
        """After trainer step ``step`` (a sync point), with ``replicas`` trainer replicas now and ``window`` the
        metrics rows since the last decision (step rows, and the row of a placement change when there was
        one): whether to move, where, and why."""
        ...

    def state(self) -> dict:
        """What the controller remembers between decisions, as plain values: a checkpoint holds it, so a resumed
        run's next decision is the one the uninterrupted run would make on the same window."""
        ...

    def load_state(self, state: dict) -> None:
        """Take up ``state()`` of the controller whose run this one resumes."""
        ...


class ForcedSchedule:
    """placement.schedule: after step s, move to n replicas, for each (s, n), whatever the measurements say."""

    def __init__(self, changes: list[tuple[int, int]]):
        self.changes = dict(changes)

    def decide(self, step: int, replicas: int, window: list[dict]) -> PlacementDecision:
        target = self.changes.get(step)
        if target is None or target == replicas:
            return PlacementDecision(step, replicas, None, "no change scheduled")
        return PlacementDecision(step, replicas, target, f"placement.schedule: {target} replicas after step {step}")

    def state(self) -> dict:
        return {}  # the schedule is all config

    def load_state(self, state: dict) -> None:
        if state:
            raise ValueError(f"placement.schedule keeps no state between decisions, got {sorted(state)}")


def build_controller(
    schedule: list[tuple[int, int]], scheduler, world_size: int, shard_degree: int, replica_options: tuple[int, ...],
    sigma: float, batch_size: int,
) -> PlacementController | None:
    """The run's placement controller: the forced ``schedule`` (placement.schedule) if there is one, else the
    planner when ``scheduler.adaptive_placement`` is on (``scheduler`` is the run's ``[scheduler]`` section),
    else None: the placement stays as started."""
    if schedule:
        return ForcedSchedule(schedule)
    if scheduler.adaptive_placement:
        return PlacementPlanner(PlannerSettings.from_section(
            scheduler, world_size, shard_degree, tuple(sorted(replica_options)), sigma, batch_size,
        ))
    return None
