"""One rollout worker's admission gate: whether the next request group may start now.

It joins the engine (its requests in flight and ``reflow.rollout.kv_signals``) to the scheduler's pure
decision objects (``reflow.scheduler.concurrency``):

  cap        rollout.max_num_seqs, or, with scheduler.adaptive_concurrency, the slow controller's cap
             (never above max_num_seqs: the engine was built for that many);
  KV rule    with scheduler.kv_admission, ``KVAdmission``: the group's estimate plus the predicted KV
             tokens of the groups in flight within rho x the engine's KV budget.

Trajectories of a multi-turn task that wait on their environment (``reflow.rollout.turns``) have left the
engine, but they come back with their whole prefix: the cap and the KV rule count them as in flight.

The gate also keeps the window statistics the worker reports to trainer rank 0 with its busy/idle
seconds: the cap, the mean KV usage over engine steps, preemptions, groups admitted, and refusals (one per
admission attempt the gate turned down: a group waits on it, and the worker retries after the next step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from reflow.config.job_config import RolloutSection, SchedulerSection
from reflow.rollout.protocols import Engine
from reflow.scheduler.concurrency import (
    AdmissionRule,
    CapDecision,
    ConcurrencyController,
    ConcurrencySettings,
    KVAdmission,
    ResponseLengths,
    groups_in_flight,
)
from reflow.scheduler.dispatch import WorkerReport
from reflow.types import WorkerStats

if TYPE_CHECKING:
    from reflow.rollout.turns import RolloutDriver


class AdmissionGate:
    def __init__(
        self, scheduler: SchedulerSection, rollout: RolloutSection, engine: Engine, group_size: int,
        turns: "RolloutDriver | None" = None, clock: Callable[[], float] = time.perf_counter,
    ):
        """``scheduler``, ``rollout``: the run's [scheduler] and [rollout] sections (the controller's and the KV
        rule's settings; the engine's max_num_seqs and max_new_tokens)."""
        self.engine = engine
        self.clock = clock
        """The controller's time (the simulator's clock in a simulation)."""
        self.turns = turns
        """The worker's turn driver, whose trajectories waiting on a tool count as in flight (None: the engine's only)."""
        self.group_size = group_size
        max_cap = rollout.max_num_seqs
        self.lengths = ResponseLengths(scheduler.response_percentile, window=256, initial=rollout.max_new_tokens)
        self.rule = AdmissionRule(
            max_cap,
            ConcurrencyController(
                ConcurrencySettings(alpha=scheduler.alpha, interval_s=scheduler.interval_s, min_cap=group_size, max_cap=max_cap),
                initial_cap=max_cap,
            ) if scheduler.adaptive_concurrency else None,
            KVAdmission(scheduler.rho, self.lengths, block_size=engine.block_size) if scheduler.kv_admission else None,
        )
        self.controller = self.rule.controller
        self.decisions: list[CapDecision] = []
        self.last_prompt_len = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self.window = {"admitted_groups": 0, "gate_refusals": 0, "kv_usage_sum": 0.0, "engine_steps": 0, "step_sequences": 0}
        self._window_preemptions_from = self.engine.signals.preemptions
        self._window_sampled_from = self.engine.sampled_tokens

    @property
    def cap(self) -> int:
        return self.rule.cap

    @staticmethod
    def _groups(in_flight: list) -> list[tuple[int, list[int]]]:
        """(prompt length, tokens generated per sequence) of every group in flight."""
        return groups_in_flight((req.meta["group"], len(req.prompt_ids), len(req.output_ids)) for req in in_flight)

    def _in_flight(self) -> list:
        waiting = list(self.turns.waiting.values()) if self.turns is not None else []
        return list(self.engine.active.values()) + waiting

    def allows(self, prompt_len: int) -> bool:
        """May a group with this prompt start now? Counts the answer."""
        self.last_prompt_len = prompt_len
        in_flight = self._in_flight()
        refusal = self.rule.refuses(
            len(in_flight), self.engine.signals.kv_budget_tokens, prompt_len, self.group_size,
            lambda: self._groups(in_flight),
        )
        self.window["gate_refusals" if refusal else "admitted_groups"] += 1
        return refusal is None

    def load(self, started: int) -> WorkerReport | None:
        """What the global dispatcher weighs (None without the KV rule), the next group's estimate for the prompt
        length of the group last offered (the typical one); ``started``: samples the worker has started."""
        if self.rule.kv_rule is None:
            return None
        in_flight = self._in_flight()
        load, estimate = self.rule.load(
            len(in_flight), self.engine.signals.kv_budget_tokens, self.last_prompt_len, self.group_size,
            self._groups(in_flight),
        )
        return WorkerReport(load, estimate, started)

    def after_step(self, finished_lengths: list[int], sequences: int) -> None:
        """After an engine ``step`` over ``sequences`` sequences (its ``decode_steps`` decode steps)."""
        self.after_steps(finished_lengths, [sequences] * self.engine.decode_steps)

    def after_steps(self, finished_lengths: list[int], step_sequences: list[int]) -> None:
        """After decode steps over ``step_sequences`` sequences each (one_step_off's first-token steps before a
        sync run many): learn the finished lengths, count the steps, feed the controller the engine's signals."""
        for length in finished_lengths:
            self.lengths.add(length)
        signals = self.engine.signals
        self.window["kv_usage_sum"] += signals.kv_usage * len(step_sequences)
        self.window["engine_steps"] += len(step_sequences)
        self.window["step_sequences"] += sum(step_sequences)
        if self.controller is not None:
            decision = self.controller.observe(
                self.clock(), signals.kv_usage, signals.kv_budget_tokens, len(self._in_flight()), signals.preemptions
            )
            if decision is not None and decision.reason != "hold":
                self.decisions.append(decision)

    def report(self) -> WorkerStats:
        """The window's statistics, the worker's times left at zero (then a new window starts)."""
        steps = self.window["engine_steps"]
        out = WorkerStats(
            engine_steps=steps,
            step_sequences=self.window["step_sequences"],
            sampled_tokens=self.engine.sampled_tokens - self._window_sampled_from,
            preemptions=self.engine.signals.preemptions - self._window_preemptions_from,
            admitted_groups=self.window["admitted_groups"],
            gate_refusals=self.window["gate_refusals"],
            kv_usage_sum=self.window["kv_usage_sum"],
            cap=self.cap,
            cap_changes=tuple((d.reason, d.previous, d.cap) for d in self.decisions),
        )
        self.decisions = []
        self._reset_window()
        return out
