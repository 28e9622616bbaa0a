"""The placement planner (the paper's Algorithm 1): how many trainer replicas, and so how many rollout ranks,
the run should have, from what the last window measured. Plain Python: measurements in, a decision out.

1. Rates, corrected for waiting. Over the window (the steps since the last decision) the rollout ranks
   produced ``produced`` samples in ``rollout_busy_s`` rank-seconds of engine time, and the trainer trained
   ``trained`` samples in ``seconds - trainer_wait_s`` seconds of not waiting for data. So

       p = produced / rollout_busy_s                     samples per rollout rank-second, unblocked
       c = trained / (seconds - trainer_wait_s) / n      samples per trainer replica-second, not starving

   A rollout rank idle because the dispatch budget (B_max, the staleness window) has no room, or a trainer
   waiting for samples, lowers the raw rates but not these: waiting is not mistaken for slowness.
2. Extrapolation. Placement (n replicas of S ranks, R = world - n S rollout ranks) would produce P = p R
   and consume C = c n samples per second.
3. Score. Each batch needs a fresh share of at least 1 - sigma (the rest may be replayed), so the target
   fresh-data coverage is P / C = 1 - sigma; a placement's score is its mismatch |ln(P / C / (1 - sigma))|:
   0 when generation exactly feeds the trainer's fresh demand, growing as either side would wait.
4. Decision. Move to the best-scoring placement only if (a) its score beats the current one's by
   ``margin``, (b) ``cooldown_steps`` steps have passed since the last change, and (c) the time it is
   predicted to save over the next ``horizon_steps`` steps exceeds the cost of a transition (the last
   measured one, else ``transition_cost_s``). Throughput X = min(C, P / (1 - sigma)) samples per second;
   a step of b samples takes b / X.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlannerSettings:
    world_size: int
    shard_degree: int
    replica_options: tuple[int, ...]
    """Trainer replica counts the run can switch to (the feasible placements built at startup)."""
    sigma: float
    batch_size: int
    """Samples per trainer step (b)."""
    cooldown_steps: int = 4
    margin: float = 0.1
    horizon_steps: int = 20
    transition_cost_s: float = 2.0


@dataclass(frozen=True)
class WindowMeasurement:
    """What the steps since the last decision measured (sums over the window)."""

    steps: int
    seconds: float
    produced: int
    """Samples the rollout ranks delivered to trainer shards."""
    trained: int
    """Samples trained (fresh and replayed)."""
    trainer_wait_s: float
    """Seconds the trainer waited for samples."""
    rollout_busy_s: float
    """Engine seconds, summed over the rollout ranks."""
    rollout_idle_s: float
    """Seconds with nothing to generate, summed over the rollout ranks."""
    transition_s: float | None = None
    """The cost of the placement change measured in the window, if there was one."""

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "WindowMeasurement":
        """From the decoupled modes' metrics rows (and transition rows, which carry ``transition_s``)."""
        steps = [r for r in rows if "transition" not in r]
        changes = [r["transition_s"] for r in rows if "transition" in r]
        return cls(
            steps=len(steps),
            seconds=sum(r["step_time_s"] for r in steps),
            produced=sum(r["received_samples"] for r in steps),
            trained=sum(r["fresh_samples"] + r["replayed_samples"] for r in steps),
            trainer_wait_s=sum(r["trainer_wait_s"] for r in steps),
            rollout_busy_s=sum(r["rollout_busy_s"] for r in steps),
            rollout_idle_s=sum(r["rollout_idle_s"] for r in steps),
            transition_s=changes[-1] if changes else None,
        )


@dataclass(frozen=True)
class Candidate:
    replicas: int
    rollout_ranks: int
    production: float
    """Predicted samples per second generated."""
    consumption: float
    """Predicted samples per second trained when never starved."""
    score: float
    step_s: float
    """Predicted seconds per trainer step."""


@dataclass(frozen=True)
class PlacementDecision:
    step: int
    current: int
    target: int | None
    """Replicas to move to, or None to stay."""
    reason: str
    production_rate: float | None = None
    consumption_rate: float | None = None
    candidates: list[Candidate] = field(default_factory=list)
    predicted_saving_s: float | None = None
    transition_cost_s: float | None = None

    def as_row(self) -> dict:
        """For metrics.jsonl: the inputs, every candidate's score and the outcome."""
        row = {
            "planner_current_replicas": self.current,
            "planner_target_replicas": self.target if self.target is not None else self.current,
            "planner_reason": self.reason,
        }
        if self.production_rate is not None:
            row.update(
                planner_production_per_rank_s=self.production_rate,
                planner_consumption_per_replica_s=self.consumption_rate,
                planner_scores={str(c.replicas): round(c.score, 4) for c in self.candidates},
                planner_step_s={str(c.replicas): round(c.step_s, 3) for c in self.candidates},
                planner_predicted_saving_s=self.predicted_saving_s,
                planner_transition_cost_s=self.transition_cost_s,
            )
        return row


class PlacementPlanner:
    """A ``PlacementController``: scores every feasible placement at each sync point (``decide``)."""

    def __init__(self, settings: PlannerSettings):
        if not 0 <= settings.sigma < 1:
            raise ValueError(f"sigma must be in [0, 1), got {settings.sigma}")
        self.settings = settings
        self.last_change_step = 0  # the run's start counts as a change: a first window of cooldown_steps
        self.transition_cost_s = settings.transition_cost_s
        self.decisions: list[PlacementDecision] = []

    def rates(self, window: WindowMeasurement, replicas: int) -> tuple[float, float] | None:
        """(p, c) of step 1, or None when the window measured too little to tell."""
        working = window.seconds - window.trainer_wait_s
        if window.steps == 0 or window.rollout_busy_s <= 0 or working <= 0 or window.produced == 0:
            return None
        return window.produced / window.rollout_busy_s, window.trained / working / replicas

    def candidates(self, production_rate: float, consumption_rate: float) -> list[Candidate]:
        settings = self.settings
        fresh_share = 1.0 - settings.sigma
        out = []
        for replicas in settings.replica_options:
            rollout = settings.world_size - replicas * settings.shard_degree
            production, consumption = production_rate * rollout, consumption_rate * replicas
            score = abs(math.log(production / consumption / fresh_share))
            throughput = min(consumption, production / fresh_share)
            out.append(Candidate(replicas, rollout, production, consumption, score, settings.batch_size / throughput))
        return out

    def decide(self, step: int, replicas: int, window: list[dict]) -> PlacementDecision:
        decision = self._decide(step, replicas, WindowMeasurement.from_rows(window))
        if decision.target is not None:
            self.last_change_step = step
        self.decisions.append(decision)
        return decision

    def _decide(self, step: int, replicas: int, window: WindowMeasurement) -> PlacementDecision:
        settings = self.settings
        if window.transition_s is not None:
            self.transition_cost_s = window.transition_s
        rates = self.rates(window, replicas)
        if rates is None:
            return PlacementDecision(step, replicas, None, "too little measured in the window")
        production_rate, consumption_rate = rates
        candidates = self.candidates(production_rate, consumption_rate)
        current = next(c for c in candidates if c.replicas == replicas)
        best = min(candidates, key=lambda c: (c.score, c.step_s))
        saving = settings.horizon_steps * (current.step_s - best.step_s)
        detail = dict(
            production_rate=production_rate, consumption_rate=consumption_rate, candidates=candidates,
            predicted_saving_s=saving, transition_cost_s=self.transition_cost_s,
        )
        if best.replicas == replicas:
            return PlacementDecision(step, replicas, None, "the current placement scores best", **detail)
        if best.score + settings.margin > current.score:
            return PlacementDecision(step, replicas, None, f"best ({best.replicas} replicas) within the margin", **detail)
        if step - self.last_change_step < settings.cooldown_steps:
            return PlacementDecision(step, replicas, None, "cooling down after the last change", **detail)
        if saving <= self.transition_cost_s:
            return PlacementDecision(step, replicas, None, "predicted saving below the transition cost", **detail)
        return PlacementDecision(
            step, replicas, best.replicas,
            f"{best.replicas} replicas: mismatch {best.score:.2f} vs {current.score:.2f}, saves {saving:.1f}s "
            f"over {settings.horizon_steps} steps against a {self.transition_cost_s:.1f}s transition",
            **detail,
        )
