"""Scheduling decisions as plain Python: measurements and counts in, decisions out (no torch.distributed),
so the live rollout loop, tests and a simulator run the same classes."""

from reflow.scheduler.dispatch import DispatchBudget, DispatchRule, share_groups
from reflow.scheduler.placement import ForcedSchedule, PlacementController, build_controller
from reflow.scheduler.planner import PlacementDecision, PlacementPlanner, PlannerSettings

__all__ = [
    "DispatchBudget", "DispatchRule", "ForcedSchedule", "PlacementController", "PlacementDecision", "PlacementPlanner",
    "PlannerSettings", "build_controller", "share_groups",
]
