"""The placement planner (the paper's Algorithm 1, made to follow a drifting workload): how many trainer
replicas, and so how many rollout ranks, the run should have. Plain Python: measurements in, a decision out.

1. Measure, per window (the steps since the last decision), leaving out warm-up steps and steps with no
   rollout report (a step shorter than the report period):
       p  useful production: response tokens of the samples that arrived and were not evicted (they are
          trained), per rollout rank-second of engine time
       c  consumption: tokens trained (prompt and response, fresh and replayed) per trainer replica-second
          of not waiting for data
       L  the mean response length that arrived, and its trend per step: the least-squares slope of the
          windows' lengths over the last ``horizon_steps`` steps, where it is at least two standard errors
          from 0 (a one-window difference swung the prediction between half and twice the length on the live
          tiny_adaptive run; on the rollout-bound bench, whose windows' lengths scatter between 0 and 39
          tokens about a steady 14, even the least-squares slope of three or more windows did, and the run
          moved at each swing)
   A rollout rank idle because the dispatch rule has no room, or a trainer waiting for samples, lowers the
   raw rates but not these: waiting is not mistaken for slowness.
2. Smooth. Each rate and L is an EMA over windows (``ema``: the newest window's weight), so one noisy
   window moves little, while a trend shows within a few windows.
3. Predict at the horizon. The length the next ``horizon_steps`` steps will see on average is
   L_h = L + trend x horizon / 2, kept within [L / 2, 2 L] (a step change in the length is a trend for a
   window or two, not a forecast). A placement of n replicas of S ranks and R = world - n S rollout
   ranks produces P = p R / L_h samples per second and consumes C = c n / (prompt + L_h); a batch needs a
   fresh share of at least 1 - sigma, so its useful throughput is X = min(C, P / (1 - sigma)) samples per
   second, a step of b samples takes b / X.
4. Choose the highest X; within ``TIE`` of it, the candidate whose fresh coverage P / C lies in the band
   [1 - sigma, 1] (the paper's "between b(1 - sigma) and b": no replay beyond sigma, no fresh samples
   beyond what a step takes), then the one closest to the current placement.
5. Decide. Move only if (a) the choice's X beats the current one's by ``margin`` (relative), (b)
   ``cooldown_steps`` steps have passed since the last change, and (c) the time it saves over the horizon exceeds
   the cost of a transition (the last measured one, else ``transition_cost_s``). Except: when one side has idled
   above ``idle_threshold`` (the trainer waiting for samples, or the rollout ranks having no room) for
   ``idle_windows`` windows in a row, (a) and (c) are waived and the choice is taken if it moves ranks toward the
   idle side's opposite, is a placement the run has not measured (step 7: a measured one's rates already show
   what the idle side costs there; on the live trainer-heavy bench, whose rollout ranks idle in its best split,
   the waiver took the run from 2 replicas to 3, measured 6% faster, twice) and is predicted faster than the
   current placement at all (a choice won by step 4's tie-break, no faster, would move ranks back and forth); the
   cooldown still holds.
6. Hysteresis. A move back to the placement the last change left needs twice the margin, and no idle
   waiver: that placement was left on measured rates, and the side that now idles is what the trade was
   expected to cost, not new evidence (the live tiny_adaptive run went 2 -> 1 on an idle trainer and
   1 -> 2 on idle rollout ranks six steps later).
7. Each placement its own rates. The model scales a trainer replica's rate and a rollout rank's rate linearly,
   which a real machine need not do: a replica added to a small model's trainer adds a gradient all-reduce and
   its own optimizer step, and ranks may share hosts, links or cores (on the 4-rank CPU placement bench one
   replica trains 2.6x the tokens per replica-second that each of two does). So p and c are also smoothed per
   placement, over the windows the run stood in it, and forgotten ``memory_steps`` steps after its last window,
   the first window after the run's start or a change left out (it carries the start-up or the transition). A
   candidate the run has measured is predicted from its own p and c (the current placement's smoothed; one the
   run has left, the ratios of its latest stay's sums, not the smoothed rates of the moment it left, which were
   chosen for being low); one it has not, from the current placement's (the linear model). The run stays in a
   placement until a window of its own is kept before judging it. Rates are per token, so a placement measured on
   shorter answers still predicts today's length through step 3 (an earlier design compared measured tokens/s,
   which the rollout-heavy bench's swinging length, 5 to 32 tokens smoothed, kept declaring another workload). A
   move between measured placements is a measurement, not a prediction, so step 6's double margin does not apply.
8. Explore. A model that is wrong about a placement it never tried is never corrected, so while the run
   stands in the best measured placement, its unmeasured neighbours (one replica more or fewer) are tried in
   turn, the model's favourite first, after the cooldown, while two transitions cost
   at most ``explore_budget`` of the horizon's predicted time. The trial lasts the cooldown; step 7 then
   keeps it or goes back. (The CPU bench's rollout-heavy workload measured 1 replica 1.4x 2, which the model
   put at 0.5x.) A trial is judged once, at the first decision after its cooldown with a window of its own:
   if the placement it left measured faster, the run goes back without step 5's margin (both are
   measurements, and the trial was a question, not a prediction to guard against); a trial measured faster is
   kept, and from then on judged as any placement. (In the simulator at 32 GPUs a trial of 1 replica measured
   13.4 samples/s against 2's 14.4, inside the margin, and the run stayed in it for 10 of its 24 steps.)
   Steps 7 and 8 are on by default in ``[scheduler]`` (``planner_memory_steps = 100``, ``planner_explore_budget =
   0.1``; ``PlannerSettings`` alone keeps them off). On the live 4-rank CPU placement bench (``python -m
   reflow.bench placement``, every run 90 s, the three static splits and the adaptive run side by side) the
   adaptive run reached 0.990x and 0.936x the best static split (rollout-heavy, trainer-heavy) with the first
   form of steps 7 and 8 (docs/results/placement_planner_steps78.json); the fixes to the pathologies those runs
   and later ones showed (a placement judged before a window of its own, a length trend read in noise, a
   placement left or returned to judged on the rates of the moment it was left, the idle waiver between measured
   placements) gave 0.886/0.930, 0.622/0.979, 0.874/0.862, 0.759/0.888 and, with all of them, 0.973/0.917
   (docs/results/placement_planner_stays.json). With a trial judged once (step 8), one round gave 0.854/0.779 with
   both adaptive runs last (docs/results/placement_trial_judged_once_1round.json), and two rounds in rotated order
   (``--rounds 2``) 0.954/0.890 on the means, per round 0.815 and 1.128, 0.930 and 0.853
   (docs/results/placement_rounds2_trial_judged_once.json): the trainer-heavy run's second round left 2 replicas for
   1 on one window of 2's new stay and stood in 1:3, 0.88x of 2:2, for 87 steps (a placement remembered by a stay of
   one window); two more trainer-heavy rounds gave 0.872 and 0.651, 0.821 over the four
   (docs/results/placement_trainer_heavy_rounds34_trial_judged_once.json): each left 2:2 after a stay of 4-6 steps
   whose own rates came out below the static 2:2 run's, and settled in 1:3 or 3:1. The static splits themselves
   moved by up to 12% from run to run, and a 90 s run is 125 to 230 steps: each trial of a neighbour costs 4 to 10
   steps at 0.75-0.85x, and the memory forgets and tries again once a run; in its best placement the adaptive run
   trains as fast as the static split (2176 against 2092 tokens/s in steps 56-112 of the last trainer-heavy run).
   In the simulator (Qwen3-8B profile, drifting workload, ``python -m reflow.sim compare --scales 8,32,128 --steps
   24``) adaptive placement reached 1.13x, 0.96x and 1.18x the best static split while a trial was judged with the
   margin (at 32 GPUs it spent 16 of the 24 steps trying 1 and 3 replicas around the best, 2), and reaches 1.13x,
   1.01x and 1.21x with a trial judged once without it (docs/results/sim_compare_trial_judged_once.json). (The
   earlier 1.17x at 32 GPUs came from a run that left each trial of 1 replica before measuring it and so went
   between 1 and 2 replicas every 2 steps, which the simulator found faster than either.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

TIE = 0.02
"""Candidates whose predicted throughput is within this fraction of the best are tied (step 4)."""


def least_squares_slope(points: list[tuple[int, float]]) -> float:
    """The slope of the least-squares line through (x, y) points; 0 with fewer than two distinct x."""
    return _least_squares(points)[0]


def significant_slope(points: list[tuple[int, float]], t: float = 2.0) -> float:
    """The least-squares slope where it stands out of the points' scatter (at least ``t`` standard errors from 0),
    else 0: two points always fit a line, and a stationary but noisy series has a slope in every sample of it.
    With exactly collinear points (no scatter) any slope stands out."""
    slope, error = _least_squares(points)
    return slope if error is None or abs(slope) >= t * error else 0.0


def _least_squares(points: list[tuple[int, float]]) -> tuple[float, float | None]:
    """(slope, its standard error) of the least-squares line; the error is None where there is no scatter to
    judge by (fewer than three points) and the slope 0 with fewer than two distinct x."""
    if len(points) < 2:
        return 0.0, None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if not spread:
        return 0.0, None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    if len(points) < 3:
        return slope, None
    residuals = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points)
    return slope, (residuals / (len(points) - 2) / spread) ** 0.5


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
    """Relative gain in predicted throughput a change needs."""
    horizon_steps: int = 20
    transition_cost_s: float = 2.0
    ema: float = 0.5
    """Weight of the newest window in the smoothed rates and length."""
    warmup_steps: int = 2
    """Steps of the run's start left out of every measurement (compilation, first batches)."""
    idle_threshold: float = 0.3
    idle_windows: int = 2
    memory_steps: int = 0
    """Steps a placement's own rates stay valid after its last window (step 7; 0, the default: off, every
    placement is predicted from the smoothed rates of all windows)."""
    explore_budget: float = 0.0
    """Step 8 tries an unmeasured neighbour while two transitions cost at most this fraction of the horizon's
    predicted seconds (0, the default: never)."""

    @classmethod
    def from_section(cls, section, world_size: int, shard_degree: int, replica_options: tuple[int, ...], sigma: float,
                     batch_size: int) -> "PlannerSettings":
        """From the run's ``[scheduler]`` section (``SchedulerSection``) and what the run's shape fixes."""
        return cls(
            world_size=world_size, shard_degree=shard_degree, replica_options=replica_options, sigma=sigma,
            batch_size=batch_size, cooldown_steps=section.cooldown_steps, margin=section.margin,
            horizon_steps=section.horizon_steps, transition_cost_s=section.transition_cost_s, ema=section.planner_ema,
            warmup_steps=section.planner_warmup_steps, idle_threshold=section.idle_threshold,
            idle_windows=section.idle_windows, memory_steps=section.planner_memory_steps,
            explore_budget=section.planner_explore_budget,
        )


@dataclass(frozen=True)
class WindowMeasurement:
    """What the steps since the last decision measured (sums over the kept steps)."""

    steps: int
    seconds: float
    useful_tokens: float
    """Response tokens of the samples that arrived and were not evicted."""
    arrived: int
    """Samples that arrived at the trainer shards (evicted ones included)."""
    trained_samples: int
    trained_tokens: float
    """Tokens trained: prompt and response, fresh and replayed."""
    trainer_wait_s: float
    rollout_busy_s: float
    rollout_idle_s: float
    length_mean: float
    """Mean response length of what arrived."""
    transition_s: float | None = None
    """The cost of the placement change measured in the window, if there was one."""

    @classmethod
    def from_rows(cls, rows: list[dict], warmup_steps: int = 0) -> "WindowMeasurement":
        """From the decoupled modes' metrics rows (and transition rows, which carry ``transition_s``)."""
        steps = [
            r for r in rows
            if "transition" not in r and r.get("step", warmup_steps + 1) > warmup_steps
            and r["rollout_busy_s"] + r["rollout_idle_s"] > 0
        ]
        changes = [r["transition_s"] for r in rows if "transition" in r]
        arrived = sum(r["received_samples"] for r in steps)
        arrived_tokens = sum(r["received_samples"] * r.get("received_response_len_mean", r.get("response_len_mean", 0.0))
                             for r in steps)
        length = arrived_tokens / arrived if arrived else 0.0
        useful = sum((r["received_samples"] - r.get("evicted_unused", 0)) for r in steps) * length
        trained = sum(r["fresh_samples"] + r["replayed_samples"] for r in steps)
        return cls(
            steps=len(steps),
            seconds=sum(r["step_time_s"] for r in steps),
            useful_tokens=useful,
            arrived=arrived,
            trained_samples=trained,
            trained_tokens=sum(r.get("trainer_tokens", 0) for r in steps),
            trainer_wait_s=sum(r["trainer_wait_s"] for r in steps),
            rollout_busy_s=sum(r["rollout_busy_s"] for r in steps),
            rollout_idle_s=sum(r["rollout_idle_s"] for r in steps),
            length_mean=length,
            transition_s=changes[-1] if changes else None,
        )

    @property
    def trainer_idle(self) -> float:
        return self.trainer_wait_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def rollout_idle(self) -> float:
        total = self.rollout_busy_s + self.rollout_idle_s
        return self.rollout_idle_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class Rates:
    """The smoothed measurements of step 2."""

    production: float
    """Useful response tokens per rollout rank-second."""
    consumption: float
    """Trained tokens per trainer replica-second."""
    length: float
    length_trend: float
    """Change of the mean response length per step."""
    prompt_tokens: float
    """Mean trained tokens per sample beyond its response."""


@dataclass(frozen=True)
class PlacementRates:
    """Step 7: p and c smoothed over the windows the run stood in one placement, and the sums of its latest
    stay there."""

    production: float
    """Useful response tokens per rollout rank-second."""
    consumption: float
    """Trained tokens per trainer replica-second."""
    step: int
    """The decision step of its newest window."""
    stay_useful_tokens: float = 0.0
    stay_busy_s: float = 0.0
    stay_trained_tokens: float = 0.0
    stay_working_s: float = 0.0
    """The latest stay's kept windows: useful tokens and rollout busy seconds, trained tokens and trainer
    seconds not waiting (summed)."""

    def stay_average(self, replicas: int) -> "PlacementRates":
        """p and c as the ratios of the latest stay's sums: a placement the run has left is remembered by its
        whole stay, not by the smoothed rates of the moment it left (a moment chosen for their being low: on
        the live rollout-bound bench the run left 1 replica on one slow window, and the low rates that window
        left stood, 0.6x what the stay had measured, while the run trained 50 steps in a placement 0.76x as
        fast)."""
        if self.stay_busy_s <= 0 or self.stay_working_s <= 0:
            return self
        return replace(self, production=self.stay_useful_tokens / self.stay_busy_s,
                       consumption=self.stay_trained_tokens / self.stay_working_s / replicas)


@dataclass(frozen=True)
class Candidate:
    replicas: int
    rollout_ranks: int
    production: float
    """Predicted samples per second generated (and trained: not evicted)."""
    consumption: float
    """Predicted samples per second trained when never starved."""
    throughput: float
    """Predicted samples per second trained: min(consumption, production / (1 - sigma))."""
    coverage: float
    """Fresh coverage: production / consumption."""
    step_s: float
    """Predicted seconds per trainer step."""
    measured: bool = False
    """Predicted from this placement's own measured rates (step 7), not extrapolated from another's."""

    def in_band(self, sigma: float) -> bool:
        return 1.0 - sigma <= self.coverage <= 1.0


@dataclass(frozen=True)
class PlacementDecision:
    step: int
    current: int
    target: int | None
    """Replicas to move to, or None to stay."""
    reason: str
    rates: Rates | None = None
    candidates: list[Candidate] = field(default_factory=list)
    predicted_length: float | None = None
    predicted_saving_s: float | None = None
    transition_cost_s: float | None = None
    trial: bool = False
    """The move tries an unmeasured neighbour (step 8): it is judged once, after its cooldown."""

    def as_row(self) -> dict:
        """For metrics.jsonl: the inputs, every candidate's prediction and the outcome."""
        row = {
            "planner_current_replicas": self.current,
            "planner_target_replicas": self.target if self.target is not None else self.current,
            "planner_reason": self.reason,
        }
        if self.rates is not None:
            row.update(
                planner_production_tokens_per_rank_s=self.rates.production,
                planner_consumption_tokens_per_replica_s=self.rates.consumption,
                planner_length=self.rates.length,
                planner_length_trend=self.rates.length_trend,
                planner_predicted_length=self.predicted_length,
                planner_throughput={str(c.replicas): round(c.throughput, 4) for c in self.candidates},
                planner_coverage={str(c.replicas): round(c.coverage, 3) for c in self.candidates},
                planner_step_s={str(c.replicas): round(c.step_s, 3) for c in self.candidates},
                planner_predicted_saving_s=self.predicted_saving_s,
                planner_transition_cost_s=self.transition_cost_s,
                planner_measured=sorted(c.replicas for c in self.candidates if c.measured),
            )
        return row


class PlacementPlanner:
    """A ``PlacementController``: predicts every feasible placement's throughput at each sync point (``decide``)."""

    def __init__(self, settings: PlannerSettings):
        if not 0 <= settings.sigma < 1:
            raise ValueError(f"sigma must be in [0, 1), got {settings.sigma}")
        if not 0 < settings.ema <= 1:
            raise ValueError(f"the planner's ema weight must be in (0, 1], got {settings.ema}")
        self.settings = settings
        self.last_change_step = 0  # the run's start counts as a change: a first window of cooldown_steps
        self.left: int | None = None  # the replica count the last change left (step 6)
        self.trial_from: int | None = None  # the placement a trial left, until the trial is judged (step 8)
        self.transition_cost_s = settings.transition_cost_s
        self.smoothed: Rates | None = None
        self.lengths: list[tuple[int, float]] = []  # (step, mean length) of the windows in the trend's span
        self.idle_streak = {"trainer": 0, "rollout": 0}
        self.by_placement: dict[int, PlacementRates] = {}  # replicas -> its own smoothed rates (step 7)
        self.settled = False  # whether the current placement's first measured window has passed (step 7)
        self.decisions: list[PlacementDecision] = []

    # ---- memory between decisions (checkpointed) ----------------------------------------

    def state(self) -> dict:
        """What steps 2, 5 and 6 remember: the smoothed rates, the lengths of the trend's span, the idle streaks,
        the last change (its step and the replica count it left) and the transition cost. Not ``decisions``,
        which is the run's log."""
        return {
            "smoothed": asdict(self.smoothed) if self.smoothed is not None else None,
            "lengths": [list(point) for point in self.lengths],
            "idle_streak": dict(self.idle_streak),
            "last_change_step": self.last_change_step,
            "left": self.left,
            "trial_from": self.trial_from,
            "transition_cost_s": self.transition_cost_s,
            "by_placement": {str(n): asdict(own) for n, own in self.by_placement.items()},
            "settled": self.settled,
        }

    def load_state(self, state: dict) -> None:
        self.smoothed = Rates(**state["smoothed"]) if state["smoothed"] is not None else None
        self.lengths = [(int(at), float(length)) for at, length in state["lengths"]]
        self.idle_streak = {"trainer": int(state["idle_streak"]["trainer"]), "rollout": int(state["idle_streak"]["rollout"])}
        self.last_change_step = int(state["last_change_step"])
        self.left = None if state["left"] is None else int(state["left"])
        self.trial_from = None if state.get("trial_from") is None else int(state["trial_from"])
        self.transition_cost_s = float(state["transition_cost_s"])
        self.by_placement = {  # (absent from a checkpoint written before step 7: nothing measured)
            int(n): PlacementRates(**own) for n, own in state.get("by_placement", {}).items()
        }
        self.settled = bool(state.get("settled", False))

    # ---- steps 1 and 2 -------------------------------------------------------------------

    @staticmethod
    def window_rates(window: WindowMeasurement, replicas: int) -> tuple[float, float, float] | None:
        """(p, c, prompt tokens per sample) of one window, or None when it measured too little to tell."""
        working = window.seconds - window.trainer_wait_s
        if (
            window.steps == 0 or window.rollout_busy_s <= 0 or working <= 0 or window.useful_tokens <= 0
            or not window.trained_samples
        ):
            return None
        prompt = max(window.trained_tokens / window.trained_samples - window.length_mean, 0.0)
        return window.useful_tokens / window.rollout_busy_s, window.trained_tokens / working / replicas, prompt

    def observe(self, window: WindowMeasurement, replicas: int, step: int) -> Rates | None:
        measured = self.window_rates(window, replicas)
        if measured is None:
            return self.smoothed
        production, consumption, prompt = measured
        self.remember(replicas, step, production, consumption, window)
        self.lengths = [(at, length) for at, length in self.lengths if at > step - self.settings.horizon_steps]
        self.lengths.append((step, window.length_mean))
        trend = significant_slope(self.lengths)
        previous, weight = self.smoothed, self.settings.ema
        if previous is None:
            self.smoothed = Rates(production, consumption, window.length_mean, trend, prompt)
        else:
            blend = lambda old, new: (1 - weight) * old + weight * new  # noqa: E731
            self.smoothed = Rates(
                blend(previous.production, production), blend(previous.consumption, consumption),
                blend(previous.length, window.length_mean), trend, blend(previous.prompt_tokens, prompt),
            )
        return self.smoothed

    # ---- steps 3 and 4 -------------------------------------------------------------------

    def predicted_length(self, rates: Rates) -> float:
        ahead = rates.length + rates.length_trend * self.settings.horizon_steps / 2
        return max(1.0, rates.length / 2, min(2 * rates.length, ahead))

    def candidates(self, rates: Rates, current: int) -> list[Candidate]:
        """Every feasible placement's prediction at the horizon's length, from its own measured rates where the
        run has them (step 7), else from the current placement's, else from the smoothed rates of all windows."""
        settings = self.settings
        fresh_share = 1.0 - settings.sigma
        length = self.predicted_length(rates)
        here = self.by_placement.get(current)
        out = []
        for replicas in settings.replica_options:
            own = self.by_placement.get(replicas)
            if own is not None and replicas != current:
                own = own.stay_average(replicas)
            source = own or here or rates
            rollout = settings.world_size - replicas * settings.shard_degree
            production = source.production * rollout / length
            consumption = source.consumption * replicas / (rates.prompt_tokens + length)
            throughput = min(consumption, production / fresh_share)
            coverage = production / consumption if consumption > 0 else float("inf")
            step_s = settings.batch_size / throughput if throughput > 0 else float("inf")
            out.append(Candidate(replicas, rollout, production, consumption, throughput, coverage, step_s,
                                 measured=own is not None))
        return out

    def choose(self, candidates: list[Candidate], replicas: int) -> Candidate:
        best = max(c.throughput for c in candidates)
        tied = [c for c in candidates if c.throughput >= (1 - TIE) * best]
        return min(tied, key=lambda c: (not c.in_band(self.settings.sigma), abs(c.replicas - replicas)))

    # ---- steps 7 and 8 ---------------------------------------------------------------------

    def remember(self, replicas: int, step: int, production: float, consumption: float,
                 window: WindowMeasurement) -> None:
        """Blend one window's p and c into the current placement's own rates, and add its sums to the stay's
        (step 7; off at memory_steps 0). The first measured window in a placement, after the run's start or a
        change, is left out: it carries the start-up or the transition (on the live trainer-heavy bench 2
        replicas measured 59 samples/s in their first window and 133 later, and that rate stood until it was
        forgotten)."""
        if self.settings.memory_steps <= 0:
            return
        if not self.settled:
            self.settled = True
            return
        old, weight = self.by_placement.get(replicas), self.settings.ema
        sums = (window.useful_tokens, window.rollout_busy_s, window.trained_tokens, window.seconds - window.trainer_wait_s)
        if self.in_this_stay(old):  # (a new stay starts afresh)
            production = (1 - weight) * old.production + weight * production
            consumption = (1 - weight) * old.consumption + weight * consumption
            sums = tuple(a + b for a, b in zip(sums, (old.stay_useful_tokens, old.stay_busy_s, old.stay_trained_tokens,
                                                      old.stay_working_s)))
        self.by_placement[replicas] = PlacementRates(production, consumption, step, *sums)

    def measuring(self, step: int, replicas: int) -> bool:
        """Whether the run stays in the current placement until this stay has its own rates (step 7): a placement
        is judged against measured ones only once measured itself, in this stay (a return is judged on what the
        placement measures now, not on what it measured the last time), or after twice the cooldown if its
        windows measure nothing. (The live trainer-heavy bench left a trial of 1 replica after one window, which
        was the transition's and left out, on the all-windows rates, and tried it again two windows later; the
        rollout-bound one went between 1 and 2 replicas every 4 steps for 80 steps, judging each placement it
        came back to on the smoothed rates of the moment it had last left it.)"""
        return (
            self.settings.memory_steps > 0 and not self.in_this_stay(self.by_placement.get(replicas))
            and step - self.last_change_step < 2 * self.settings.cooldown_steps
        )

    def in_this_stay(self, own: PlacementRates | None) -> bool:
        """Whether a placement's own rates were measured since the last change (in the run's current stay)."""
        return own is not None and own.step > self.last_change_step

    def forget(self, step: int) -> None:
        """Drop the rates of placements whose newest window is ``memory_steps`` or more steps old: the workload
        may have drifted since."""
        oldest = step - self.settings.memory_steps
        self.by_placement = {n: own for n, own in self.by_placement.items() if own.step > oldest}

    def exploration(self, candidates: list[Candidate], replicas: int) -> Candidate | None:
        """Step 8: the unmeasured neighbour of the best measured placement to try now, or None."""
        settings = self.settings
        measured = {c.replicas: c for c in candidates if c.measured}
        if settings.explore_budget <= 0 or replicas not in measured:
            return None
        best = max(measured.values(), key=lambda c: c.throughput).replicas
        if best != replicas:  # trials start from the best measured placement, one replica away (never a jump)
            return None
        options = sorted(settings.replica_options)
        at = options.index(best)
        neighbours = {options[j] for j in (at - 1, at + 1) if 0 <= j < len(options) and options[j] not in measured}
        by_replicas = {c.replicas: c for c in candidates}
        horizon_s = settings.horizon_steps * by_replicas[replicas].step_s
        if not neighbours or 2 * self.transition_cost_s > settings.explore_budget * horizon_s:
            return None
        return max((by_replicas[n] for n in neighbours), key=lambda c: c.throughput)

    # ---- step 5 ----------------------------------------------------------------------------

    def decide(self, step: int, replicas: int, window: list[dict]) -> PlacementDecision:
        decision = self._decide(step, replicas, WindowMeasurement.from_rows(window, self.settings.warmup_steps))
        if decision.target is not None:
            self.last_change_step = step
            self.left = replicas
            self.trial_from = replicas if decision.trial else None
            self.settled = False
            self.idle_streak = {"trainer": 0, "rollout": 0}
        self.decisions.append(decision)
        return decision

    def _decide(self, step: int, replicas: int, window: WindowMeasurement) -> PlacementDecision:
        settings = self.settings
        if window.transition_s is not None:
            self.transition_cost_s = window.transition_s
        if window.steps:
            for side, idle in (("trainer", window.trainer_idle), ("rollout", window.rollout_idle)):
                self.idle_streak[side] = self.idle_streak[side] + 1 if idle > settings.idle_threshold else 0
        self.forget(step)
        rates = self.observe(window, replicas, step)
        if rates is None:
            return PlacementDecision(step, replicas, None, "too little measured yet")
        candidates = self.candidates(rates, replicas)
        decision = self._model_decision(step, replicas, rates, candidates)
        if decision.target is not None or step - self.last_change_step < self.settings.cooldown_steps:
            return decision
        trial = self.exploration(candidates, replicas)
        if trial is None:
            return decision
        return replace(
            decision, target=trial.replicas, trial=True,
            reason=f"exploring {trial.replicas} replicas, never measured (predicted {trial.throughput:.3g} samples/s, "
                   f"next to the best measured placement); {decision.reason}",
        )

    def _model_decision(self, step: int, replicas: int, rates: Rates, candidates: list[Candidate]) -> PlacementDecision:
        """Steps 4 to 6 on the (step 7) candidates: move to the chosen placement, or stay and say why."""
        settings = self.settings
        current = next(c for c in candidates if c.replicas == replicas)
        chosen = self.choose(candidates, replicas)
        saving = settings.horizon_steps * (current.step_s - chosen.step_s)
        detail = dict(
            rates=rates, candidates=candidates, predicted_length=self.predicted_length(rates),
            predicted_saving_s=saving, transition_cost_s=self.transition_cost_s,
        )
        cooling = step - self.last_change_step < settings.cooldown_steps
        measuring = self.measuring(step, replicas)
        # a trial is judged once, on its own rates, after its cooldown: the placement it left, measured faster,
        # takes the run back without the margin (both are measurements, and the trial was only ever a question)
        ends_trial = False
        if not cooling and not measuring:
            ends_trial = self.trial_from is not None and chosen.replicas == self.trial_from and chosen.measured
            self.trial_from = None
        if chosen.replicas == replicas:
            return PlacementDecision(step, replicas, None, "the current placement is predicted best", **detail)
        if cooling:
            return PlacementDecision(step, replicas, None, "cooling down after the last change", **detail)
        if measuring:
            return PlacementDecision(step, replicas, None, "measuring the current placement before judging it", **detail)
        # a trainer starving for windows wants more rollout ranks (fewer replicas); idle rollout ranks, more replicas
        idle_side = next(
            (side for side in ("trainer", "rollout") if self.idle_streak[side] >= settings.idle_windows
             and (chosen.replicas < replicas if side == "trainer" else chosen.replicas > replicas)),
            None,
        )
        summary = (
            f"{chosen.replicas} replicas: {chosen.throughput:.3g} vs {current.throughput:.3g} samples/s at a predicted "
            f"length of {self.predicted_length(rates):.0f} tokens, saves {saving:.1f}s over {settings.horizon_steps} steps "
            f"against a {self.transition_cost_s:.1f}s transition"
        )
        reverses = chosen.replicas == self.left and not chosen.measured  # (a measured one is no prediction: step 7)
        if idle_side is not None and chosen.throughput > current.throughput and not reverses and not chosen.measured:
            return PlacementDecision(
                step, replicas, chosen.replicas,
                f"{summary}; the {idle_side} side idled above {settings.idle_threshold} for "
                f"{self.idle_streak[idle_side]} windows",
                **detail,
            )
        margin = 0.0 if ends_trial else 2 * settings.margin if reverses else settings.margin
        if chosen.throughput < (1 + margin) * current.throughput:
            back = ", twice the margin back to the placement the last change left" if reverses else ""
            return PlacementDecision(step, replicas, None, f"best ({chosen.replicas} replicas) within the margin{back}", **detail)
        if saving <= self.transition_cost_s:
            return PlacementDecision(step, replicas, None, "predicted saving below the transition cost", **detail)
        if reverses:
            summary += f"; back to the placement left at step {self.last_change_step}, beyond twice the margin"
        elif ends_trial:
            summary += "; the trial measured slower than the placement it left"
        return PlacementDecision(step, replicas, chosen.replicas, summary, **detail)
