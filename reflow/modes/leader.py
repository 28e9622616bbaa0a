"""Trainer rank 0's second role, the leader: it tells the rollout workers the trainer's progress, deals the
dispatch room, gathers the rollout workers' reports and evaluations, and asks the placement controller.

No collective happens here: the mode hands the leader the combined ``TrainerView`` it computed with every
other trainer rank, and broadcasts the leader's placement answer itself. Its words go out through a
``CommandSink`` (the control channel live, the simulator's in-process transport otherwise).

  progress     ``publish``: a ``Progress`` to every rollout worker whenever the steps done, the retired
               (and filtered) counts or the shards' unused counts changed (cumulative counts: a repeated word
               is harmless; I2 of ``docs/decoupled_protocol.md``), with its grants when the
               ``GroupDispatcher`` deals
  reports      ``WorkerStats`` per rollout worker, added up over the step (``RolloutWindow``), and the
               dispatcher's view of each worker's KV load
  evaluation   each version's ``EvalShare`` from every rollout worker, logged once all have arrived
  placement    at sync points, the ``PlacementController``'s decision on the rows since its last one
"""

from __future__ import annotations

from reflow.dataplane.protocols import CommandSink
from reflow.scheduler import PlacementController
from reflow.scheduler.dispatch import DispatchRule, GroupDispatcher
from reflow.scheduler.placement import ForcedSchedule
from reflow.scheduler.planner import PlacementDecision
from reflow.types import ENGINE_WINDOW_KEYS, EvalShare, Progress, TrainerView, WorkerStats


class RolloutWindow:
    """The rollout workers' reports since the previous step, as that step's metrics. A step shorter than the
    report period (about 1 s) counts nothing: it keeps the reports for the next window and repeats the
    previous window's idle ratio, KV usage and caps."""

    def __init__(self):
        self.reports: dict[int, WorkerStats] = {}
        self.carried: dict = {"rollout_idle_ratio": 0.0, "kv_usage_mean": 0.0, "concurrency_caps": {}}

    def add(self, rank: int, stats: WorkerStats) -> None:
        self.reports[rank] = self.reports.get(rank, WorkerStats()) + stats

    def clear(self) -> None:
        self.reports = {}

    def close(self) -> dict:
        total = sum(self.reports.values(), WorkerStats())
        reports = self.reports
        if total.idle_s + total.working_s > 0:
            self.reports = {}
            self.carried = {
                "rollout_idle_ratio": total.idle_s / (total.idle_s + total.working_s),
                "kv_usage_mean": total.kv_usage_mean,
                "concurrency_caps": {str(rank): s.cap for rank, s in sorted(reports.items())},
            }
        else:
            reports, total = {}, WorkerStats()
        return {
            **self.carried,
            **{key: getattr(total, field) for key, field in ENGINE_WINDOW_KEYS.items()},
            "rollout_idle_s": total.idle_s,
            "rollout_tool_wait_s": total.tool_wait_s,
            "rollout_sync_s": total.sync_s,
            "rollout_syncs": total.syncs,
            "rollout_held_at_sync": total.held_at_sync,
            "preemptions": total.preemptions,
            "admitted_groups": total.admitted_groups,
            "gate_refusals": total.gate_refusals,
            "cap_changes": {str(rank): list(s.cap_changes) for rank, s in sorted(reports.items()) if s.cap_changes},
        }


class Evaluations:
    """Held-out evaluations by policy version, as the rollout workers' shares arrive."""

    def __init__(self):
        self.pending: dict[int, dict] = {}

    def expect(self, version: int, workers: int) -> None:
        self.pending[version] = {"expected": workers, "reward_sum": 0.0, "count": 0, "reports": 0}

    def add(self, share: EvalShare) -> None:
        pending = self.pending.get(share.version)
        if pending is not None:
            pending["reward_sum"] += share.reward_sum
            pending["count"] += share.count
            pending["reports"] += 1

    def finished(self) -> dict:
        """The newest evaluation every worker has reported, as ``eval_reward`` with the ``eval_policy_version``
        it measured (older finished ones are superseded); {} if none finished."""
        done = [v for v, p in self.pending.items() if p["reports"] >= p["expected"]]
        if not done:
            return {}
        latest = self.pending[max(done)]
        for version in [v for v in self.pending if v <= max(done)]:
            del self.pending[version]
        return {"eval_reward": latest["reward_sum"] / max(latest["count"], 1), "eval_policy_version": max(done)}


class Leader:
    def __init__(self, sink: CommandSink, group_size: int, controller: PlacementController | None):
        self.sink = sink
        self.group_size = group_size
        self.controller = controller
        self.evaluations = Evaluations()
        self.rollout_window = RolloutWindow()
        self.placement_rows: list[dict] = []
        """Metrics rows (and transition events) since the controller's last decision."""
        self.rollout_workers: list[int] = []
        self.dispatcher: GroupDispatcher | None = None
        self.published: tuple | None = None
        self.dealt_groups: dict[str, int] = {}

    def enter(self, rollout_workers: list[int], dispatcher: GroupDispatcher | None) -> None:
        """A placement starts: its rollout workers, and the dealer of its dispatch room (None: fixed shares)."""
        self.rollout_workers = list(rollout_workers)
        self.dispatcher = dispatcher
        self.published = None
        self.dealt_groups = {}
        self.rollout_window.clear()  # the previous placement's rollout ranks do not count in the new one's ratio

    @staticmethod
    def new_dispatcher(
        rule: DispatchRule, num_rollout: int, group_size: int, rho: float, step: int, *, dealt: bool,
    ) -> GroupDispatcher | None:
        """The dealer of a placement's dispatch room, starting at ``step`` (scheduler.kv_admission, which only
        async and reflow accept); None when every rollout worker owns a fixed share or none generates."""
        return GroupDispatcher(rule, num_rollout, group_size, rho, start_step=step) if dealt and num_rollout else None

    # ---- data plane --------------------------------------------------------------------

    def receive_stats(self, src: int, stats: WorkerStats) -> None:
        self.rollout_window.add(src, stats)
        if self.dispatcher is not None and stats.load is not None and src in self.rollout_workers:
            self.dispatcher.report(self.rollout_workers.index(src), stats.load)

    # ---- progress ----------------------------------------------------------------------

    def publish(self, steps_done: int, view: TrainerView) -> None:
        progress = (steps_done, view.retired, view.filtered, view.unused)
        if progress == self.published:
            return
        self.published = progress
        granted = None
        if self.dispatcher is not None:
            before = list(self.dispatcher.granted)
            # I3: all the room the rule allows, at once (filtered samples refund B_max)
            granted = self.dispatcher.deal(steps_done, list(view.retired), list(view.filtered))
            for worker, rank in enumerate(self.rollout_workers):
                dealt = (granted[worker] - before[worker]) // self.group_size
                self.dealt_groups[str(rank)] = self.dealt_groups.get(str(rank), 0) + dealt
        for worker, rank in enumerate(self.rollout_workers):
            grant = granted[worker] if granted is not None else None
            self.sink.send(rank, Progress(steps_done, view.retired[worker], grant, view.unused, view.filtered[worker]))

    def step_row(self) -> dict:
        """The leader's part of a step's row: the rollout window, the groups dealt since the previous step (under
        a dealing dispatcher) and an evaluation that finished meanwhile."""
        row = self.rollout_window.close()
        dealt = self.take_dealt()
        if dealt is not None:
            row["dispatched_groups"] = dealt
        row.update(self.evaluations.finished())
        return row

    def take_dealt(self) -> dict[str, int] | None:
        """Groups the dispatcher granted each rollout rank since the previous step (None: fixed shares)."""
        if self.dispatcher is None:
            return None
        dealt, self.dealt_groups = self.dealt_groups, {}
        return dealt

    # ---- placement ---------------------------------------------------------------------

    def decide_placement(self, step: int, replicas: int) -> PlacementDecision | None:
        """The controller's decision on the rows since its last one (None without a controller)."""
        if self.controller is None:
            return None
        decision = self.controller.decide(step, replicas, self.placement_rows)
        self.placement_rows = []
        return decision

    def controller_state(self) -> dict | None:
        """For a checkpoint after a step's decision: the controller's memory and the rows since its decision
        (None without a controller)."""
        if self.controller is None:
            return None
        return {
            "kind": type(self.controller).__name__, "controller": self.controller.state(), "window": list(self.placement_rows),
        }

    def load_controller_state(self, state: dict) -> str | None:
        """Take up ``controller_state()`` of the run this one resumes. A controller of another kind (the resumed
        run switched between placement.schedule and the planner) starts afresh: returns why, or None."""
        if self.controller is None:
            return None
        kind = type(self.controller).__name__
        if state.get("kind") != kind:
            return f"the checkpoint's placement controller was {state.get('kind')}, this run's is {kind}: it starts afresh"
        self.controller.load_state(state["controller"])
        self.placement_rows = list(state["window"])
        return None

    def logs_decision(self, decision: PlacementDecision) -> bool:
        """A forced schedule's no-ops are noise; every other decision is logged."""
        return decision.target is not None or not isinstance(self.controller, ForcedSchedule)
