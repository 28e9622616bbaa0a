"""Adaptive generation scheduling: a slow concurrency controller per rollout worker, and the fast admission
rule that places each request group under a KV-cache bound. Plain Python: engine signals in, decisions out.

Slow controller (``ConcurrencyController``), every ``interval_s`` seconds of a worker's engine time. It keeps
exponential moving averages (factor alpha) of the KV usage u and of the growth of the KV tokens in use, dP
(tokens per second), and projects the usage ``horizon_s`` ahead: u' = u + dP x horizon_s / budget. Then,
first rule that applies:

  cut     a preemption since the last update: cap = cut x in-flight (the engine freed a request's KV
          blocks to make room: it is over-committed now, whatever the averages say);
  trim    u' above ``high_usage``: cap = in-flight x target_usage / max(u, u') (aim the usage back at the
          target);
  grow    u' below ``low_usage`` while the cap binds (admissions waited on it): cap x grow.

prime-rl's orchestrator applies the same three moves on the usage alone (grow x1.25 below 0.6, trim to
inflight x 0.7 / usage above 0.8, cut to 0.8 x inflight on preemption); the dP term (the paper's) holds off a
grow, or trims early, while the in-flight requests' KV is still growing toward the budget: long responses
fill the cache well after they were admitted.

Fast admission (``KVAdmission``), before each request group: admit it to the worker only if that worker's
predicted KV tokens plus the group's estimate stay within rho x its budget, ``(T_pred + T_hat) / budget <=
rho``, and the worker's cap has room for the group. T_hat counts the shared prompt once (vLLM's prefix cache
shares its full blocks) and each response at a recent high percentile of finished response lengths, in
whole KV blocks; T_pred is the peak the cache will reach with the group started, if each running response
ends at the mean of the recent lengths that reached its current length (its expected end: a high percentile
for every running sequence would count the tail once per sequence) and the new ones at the estimate: sequences
free their blocks as they end, so the peak, reached just before one of them ends, is what has to fit, not the
sum of every sequence's final size, which would leave the cache half empty. A worker with nothing in flight always
admits (a group larger than rho x budget must still run, and the engine then preempts rather than
deadlocks). Each rollout worker applies the rule to its own engine, whose KV cache is its own, and decides
when its next group starts; which worker takes a group is the global dispatcher's choice
(``reflow.scheduler.dispatch.GroupDispatcher``), on the same estimates.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class ConcurrencySettings:
    alpha: float = 0.3
    """EMA factor of the usage and growth averages (weight of the newest measurement)."""
    interval_s: float = 2.0
    """Seconds between two updates of a worker's cap."""
    low_usage: float = 0.6
    high_usage: float = 0.8
    target_usage: float = 0.7
    grow: float = 1.25
    cut: float = 0.8
    horizon_s: float = 2.0
    """How far ahead the KV growth projects the usage."""
    min_cap: int = 1
    max_cap: int = 1 << 30


@dataclass(frozen=True)
class CapDecision:
    """One update of a worker's cap, with the inputs that made it (logged)."""

    cap: int
    previous: int
    reason: str
    """'cut', 'trim', 'grow' or 'hold'."""
    usage_ema: float
    growth_ema: float
    projected_usage: float
    in_flight: int
    preemptions: int


class ConcurrencyController:
    """The slow loop of one rollout worker: how many sequences it may have in flight."""

    def __init__(self, settings: ConcurrencySettings, initial_cap: int):
        self.settings = settings
        self.cap = self._clamp(initial_cap)
        self.usage_ema: float | None = None
        self.growth_ema = 0.0
        self._last_time: float | None = None
        self._last_tokens = 0.0
        self._last_preemptions = 0
        self._binding = False  # did an admission wait on the cap since the last update?

    def _clamp(self, cap: float) -> int:
        return max(self.settings.min_cap, min(self.settings.max_cap, int(cap)))

    def note_cap_binding(self) -> None:
        """The worker had a group to admit and the cap stopped it."""
        self._binding = True

    def observe(self, now: float, kv_usage: float, kv_budget_tokens: int, in_flight: int, preemptions: int) -> CapDecision | None:
        """Feed the engine's signals after a step (``now`` in seconds, ``preemptions`` cumulative). Returns a
        decision once per ``interval_s``, None in between."""
        settings = self.settings
        tokens = kv_usage * kv_budget_tokens
        if self._last_time is None:
            self._last_time, self._last_tokens, self._last_preemptions = now, tokens, preemptions
            self.usage_ema = kv_usage
            return None
        elapsed = now - self._last_time
        if elapsed < settings.interval_s:
            return None
        growth = (tokens - self._last_tokens) / elapsed
        self.usage_ema = settings.alpha * kv_usage + (1 - settings.alpha) * self.usage_ema
        self.growth_ema = settings.alpha * growth + (1 - settings.alpha) * self.growth_ema
        projected = self.usage_ema + max(self.growth_ema, 0.0) * settings.horizon_s / max(kv_budget_tokens, 1)
        previous = self.cap
        if preemptions > self._last_preemptions:
            reason, cap = "cut", settings.cut * in_flight
        elif projected > settings.high_usage and self.usage_ema > 0:
            reason, cap = "trim", in_flight * settings.target_usage / max(self.usage_ema, projected)
        elif projected < settings.low_usage and self._binding:
            reason, cap = "grow", math.ceil(self.cap * settings.grow)
        else:
            reason, cap = "hold", self.cap
        if reason in ("cut", "trim"):
            cap = min(cap, self.cap)  # pressure never raises the cap (in-flight may exceed it after a grow)
        self.cap = self._clamp(cap)
        decision = CapDecision(
            cap=self.cap, previous=previous, reason=reason, usage_ema=self.usage_ema, growth_ema=self.growth_ema,
            projected_usage=projected, in_flight=in_flight, preemptions=preemptions - self._last_preemptions,
        )
        self._last_time, self._last_tokens, self._last_preemptions = now, tokens, preemptions
        self._binding = False
        return decision


class ResponseLengths:
    """A recent window of finished response lengths and a high percentile of it (the estimate for new ones)."""

    def __init__(self, percentile: float, window: int, initial: int):
        if not 0 < percentile <= 1:
            raise ValueError(f"percentile must be in (0, 1], got {percentile}")
        self.percentile = percentile
        self.recent: deque[int] = deque(maxlen=window)
        self.initial = initial

    def add(self, length: int) -> None:
        self.recent.append(length)

    def expected_final(self, current: int) -> float:
        """A sequence that has ``current`` tokens: the mean of the recent lengths that reached ``current``
        (what it is expected to end at), or the high-percentile estimate when none did (``current`` if longer)."""
        reached = [length for length in self.recent if length >= current]
        if not reached:
            return max(current, self.estimate())
        return sum(reached) / len(reached)

    def estimate(self) -> int:
        """The percentile of the window (nearest rank); ``initial`` (the longest allowed) before any finished."""
        if not self.recent:
            return self.initial
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(self.percentile * len(ordered)) - 1))]


@dataclass(frozen=True)
class WorkerLoad:
    """What the admission rule needs of one rollout worker."""

    predicted_tokens: float
    """T_pred: the peak KV tokens its in-flight groups are predicted to hold (``KVAdmission.peak_tokens``)."""
    kv_budget_tokens: int
    in_flight: int
    """Sequences in flight."""
    cap: int


class KVAdmission:
    """The fast admission rule: ``(T_pred + T_hat) / budget <= rho`` and room under the cap.

    Estimates are in KV tokens as the engine pages them, ``block_size`` tokens at a time: the prompt's full
    blocks once per group (the prefix cache shares them), and per sequence the blocks that hold the rest of
    the prompt and its response (1: count tokens exactly)."""

    def __init__(self, rho: float, lengths: ResponseLengths, block_size: int = 1):
        if not 0 < rho <= 2:
            raise ValueError(f"rho must be in (0, 2], got {rho}")
        self.rho = rho
        self.lengths = lengths
        self.block_size = block_size

    def group_tokens(self, prompt_len: int, response_lengths: list[int]) -> int:
        """KV tokens of a group whose sequences reach these response lengths."""
        size = self.block_size
        shared_blocks, rest = divmod(prompt_len, size)
        return size * (shared_blocks + sum(-(-(rest + length) // size) for length in response_lengths))

    def group_estimate(self, prompt_len: int, group_size: int) -> int:
        """T_hat of a group about to start: each response at the high-percentile estimate."""
        return self.group_tokens(prompt_len, [self.lengths.estimate()] * group_size)

    def peak_tokens(self, groups: Iterable[tuple[int, list[int]]], new_groups: Iterable[tuple[int, int]] = ()) -> float:
        """T_pred: the most KV tokens the groups in flight ((prompt length, tokens generated per sequence)) and
        ``new_groups`` ((prompt length, group size)) starting now will hold at once, if every running response
        ends at the length it is expected to end at (``ResponseLengths.expected_final``) and every new one at
        the high-percentile estimate, one token per engine step each. A sequence frees its blocks when it
        ends, so the peak is below the sum of the final sizes: it is reached just before some sequence ends,
        t steps from now, holding every sequence still running then at its length then. A group's full prompt
        blocks are held once, until its last sequence ends; a sequence's own tokens are counted with half a
        block for the partly filled last one."""
        size = self.block_size
        partial_block = (size - 1) / 2
        items: list[tuple[int, float, int]] = []  # (steps until it ends, tokens held now, tokens added per step)

        def add(prompt_len: int, now: list[int], final: list[int]) -> None:
            shared_blocks, rest = divmod(prompt_len, size)
            remaining = [max(end - have, 0) for have, end in zip(now, final)]
            items.append((max(remaining), float(size * shared_blocks), 0))
            items.extend((left, rest + have + partial_block, 1) for have, left in zip(now, remaining))

        for prompt_len, generated in groups:
            add(prompt_len, generated, [math.ceil(self.lengths.expected_final(have)) for have in generated])
        estimate = self.lengths.estimate()
        for prompt_len, group_size in new_groups:
            add(prompt_len, [0] * group_size, [estimate] * group_size)
        items.sort(key=lambda item: -item[0])
        peak = held = growing = 0.0
        for index, (left, tokens, grows) in enumerate(items):  # t = left, longest first
            held += tokens
            growing += grows
            if index + 1 == len(items) or items[index + 1][0] < left:  # every item still running at t counted
                peak = max(peak, held + growing * left)
        return peak

    def admits(self, load: WorkerLoad, group_size: int) -> bool:
        """``load.predicted_tokens``: T_pred with the group started (``peak_tokens`` with it among the new)."""
        if load.in_flight == 0:
            return True
        if load.in_flight + group_size > load.cap:
            return False
        return load.predicted_tokens / max(load.kv_budget_tokens, 1) <= self.rho


def groups_in_flight(sequences: Iterable[tuple[str, int, int]]) -> list[tuple[int, list[int]]]:
    """(prompt length, tokens generated per sequence) per group, from (group, prompt length, generated) per
    sequence in flight: what ``AdmissionRule.refuses`` asks of the KV rule."""
    groups: dict[str, tuple[int, list[int]]] = {}
    for group, prompt_len, generated in sequences:
        groups.setdefault(group, (prompt_len, []))[1].append(generated)
    return list(groups.values())


class AdmissionRule:
    """The whole admission decision of one rollout worker, for the live gate (``reflow.rollout.admission``) and
    the simulator alike: the concurrency cap (``max_cap``, or the controller's) and, when on, the KV rule."""

    def __init__(self, max_cap: int, controller: ConcurrencyController | None, kv_rule: KVAdmission | None):
        self.max_cap = max_cap
        self.controller = controller
        self.kv_rule = kv_rule

    @property
    def cap(self) -> int:
        return min(self.controller.cap, self.max_cap) if self.controller is not None else self.max_cap

    def refuses(
        self, in_flight: int, kv_budget_tokens: int, prompt_len: int, group_size: int,
        groups_in_flight: Callable[[], list[tuple[int, list[int]]]],
    ) -> str | None:
        """Why a group with this prompt may not start now ("cap" or "kv"), or None. ``groups_in_flight`` lists
        (prompt length, tokens generated per sequence) of the groups in flight (asked only for the KV rule).
        A worker with nothing in flight always admits. A refusal by the cap tells the controller its cap binds."""
        if in_flight == 0:
            return None
        if in_flight + group_size > self.cap:
            if self.controller is not None:
                self.controller.note_cap_binding()
            return "cap"
        if self.kv_rule is not None:
            predicted = self.kv_rule.peak_tokens(groups_in_flight(), [(prompt_len, group_size)])
            if not self.kv_rule.admits(WorkerLoad(predicted, kv_budget_tokens, in_flight, self.cap), group_size):
                return "kv"
        return None

    def load(
        self, in_flight: int, kv_budget_tokens: int, prompt_len: int, group_size: int,
        groups_in_flight: list[tuple[int, list[int]]],
    ) -> tuple[WorkerLoad, float]:
        """What the global dispatcher weighs of this worker (the KV rule must be on): its load, with T_pred the
        peak of the groups in flight, and the estimate T_hat of a next group with this prompt length."""
        predicted = self.kv_rule.peak_tokens(groups_in_flight)
        return WorkerLoad(predicted, kv_budget_tokens, in_flight, self.cap), self.kv_rule.group_estimate(prompt_len, group_size)
