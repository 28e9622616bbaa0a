"""A simulated rollout engine: continuous batching over a paged KV cache, as vLLM's V1 scheduler does it, behind
the live ``Engine`` protocol (``reflow.rollout.protocols``), so that the live ``RolloutWorker`` drives it.

It takes and returns the live ``Request``; what the simulation needs of one beyond that (the response length
the workload drew, its tool calls) rides in ``request.meta["sim"]`` (``SimTrajectory``). Each engine has its
own clock and advances in *macro-steps* of up to ``max_steps`` decode steps (fewer if a sequence finishes, a
tool call starts, the cache would overflow or the clock would pass ``until`` first), each costed by the
profile; ``step_until_started`` runs single decode steps, as the live engine's first-token steps are. The
scheduler moves waiting sequences (new, resumed or preempted) into the running set while the KV cache has
blocks and the running set has room; when a running sequence needs a block that is not there, the newest
running sequence is preempted (its blocks freed; it waits and its prefix is recomputed, costed as prefill).
A group's prompt blocks that are full are shared by its sequences (the prefix cache). A weight reload
empties the prefix cache: every request resumed after it prefills its prompt and prefix again.

A sequence at its tool stays in the engine (``in_tool``, holding its KV blocks) until the tool's latency has
passed; the live turn driver takes it out of the engine meanwhile, and resumes it from its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from reflow.rollout.kv_signals import EngineSignals
from reflow.rollout.request import Request
from reflow.sim.profiles import CostProfile
from reflow.sim.runs import Runs


@dataclass
class SimTrajectory:
    """What the simulation knows of a request beyond the live fields (``request.meta["sim"]``), and the counts
    the engine's inner loops read instead of the request's lists (the simulator's hottest code)."""

    target_tokens: int
    """The response length the workload drew: the request finishes there."""
    turn_points: list[int] = field(default_factory=list)
    """Response lengths at which the sequence calls its tool (and waits ``tool_latency_s`` for it)."""
    tool_latency_s: float = 0.0
    resume_at: float = 0.0
    needs_prefill: int = 0
    """Tokens to (re)compute when next scheduled."""
    request: Request | None = field(default=None, repr=False)
    prompt_tokens: int = 0
    generated: int = 0
    """``len(request.prompt_ids)``, ``len(request.output_ids)``: set when an engine takes the request."""
    group: str = ""
    prompt_full_blocks: int = 0
    prompt_rest: int = 0
    """The group, and the prompt's full KV blocks (shared by the group) and the tokens past them: set with
    ``prompt_tokens``."""

    @property
    def remaining(self) -> int:
        return self.target_tokens - self.generated


def trajectory(req: Request) -> SimTrajectory:
    return req.meta["sim"]


class SimEngine:
    """An ``Engine`` on a simulated clock (``clock``, advanced by its own steps and by ``wait_until``)."""

    mirror = None
    pins_versions = False
    """(Full-weight syncs: the simulator does not model LoRA's adapter versions.)"""

    def __init__(self, profile: CostProfile, index: int, max_steps: int = 32, macro_s: float = 0.0):
        self.profile = profile
        self.index = index
        self.max_steps = max_steps
        self.macro_s = macro_s
        """A macro-step runs more than ``max_steps`` decode steps where they take less than this many seconds
        (a small batch's steps are short): the same granularity in time as a full engine's (0: steps only)."""
        self.block_size = profile.kv_block_size
        self.clock = 0.0
        self.until = float("inf")
        """No macro-step runs past this time (the simulator sets it while the trainer trains)."""
        self.version = 0
        self.asleep = False
        """Put to sleep by a rank that joins the trainer; a weight load wakes it (``RolloutEngine``'s rule)."""
        self.running: list[SimTrajectory] = []
        self.waiting: list[SimTrajectory] = []
        self.in_tool: list[SimTrajectory] = []
        self.active: dict[str, Request] = {}
        self.decode_steps = 0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.engine_steps = 0
        self.step_sequences = 0
        """Requests in flight (running, queued and at a tool) summed over the decode steps, as the live
        worker counts them (``num_active`` before each step)."""
        self.sampled_tokens = 0
        """(``Engine.sampled_tokens``) the running sequences summed over the decode steps."""
        self.preemptions = 0
        self.prefilled_tokens = 0
        self.kv_usage_sum = 0.0
        self.budget_blocks = profile.kv_budget_tokens // profile.kv_block_size
        self.signals = self._signals()

    # ---- KV accounting -----------------------------------------------------------

    def _blocks(self, sequences: list[SimTrajectory], extra: int = 0) -> int:
        """Blocks ``sequences`` hold after ``extra`` more tokens each (full prompt blocks shared per group)."""
        shared: dict[str, int] = {}
        return sum(self._own_blocks(seq, shared, extra) for seq in sequences) + sum(shared.values())

    def _own_blocks(self, seq: SimTrajectory, shared: dict[str, int], extra: int = 0) -> int:
        """The blocks ``seq`` holds alone after ``extra`` more tokens; its group's full prompt blocks go to
        ``shared`` (counted once per group)."""
        shared[seq.group] = seq.prompt_full_blocks
        return -(-(seq.prompt_rest + seq.generated + extra) // self.block_size)

    def _fits(self, sequences: list[SimTrajectory], extra: int, tokens: int | None = None) -> bool:
        """``_blocks(sequences, extra) <= budget``, with a quick bound first: without sharing, each sequence holds
        at most one block more than its tokens fill. ``tokens``: their prompt and generated tokens, if known."""
        if tokens is None:
            tokens = sum(seq.prompt_tokens + seq.generated for seq in sequences)
        if (tokens + extra * len(sequences)) // self.block_size + len(sequences) <= self.budget_blocks:
            return True
        return self._blocks(sequences, extra) <= self.budget_blocks

    def kv_usage(self) -> float:
        return min(1.0, self._blocks(self.running + self.in_tool) / max(self.budget_blocks, 1))

    def _signals(self, kv_usage: float | None = None) -> EngineSignals:
        return EngineSignals(
            kv_usage=self.kv_usage() if kv_usage is None else kv_usage, kv_budget_tokens=self.profile.kv_budget_tokens,
            running=len(self.running), waiting=len(self.waiting), preemptions=self.preemptions,
        )

    @property
    def num_active(self) -> int:
        return len(self.active)

    # ---- the Engine protocol -------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a request; one with output already (a held partial rollout) prefills its prompt and prefix
        again, and one whose tool has not answered yet waits for it first."""
        if self.asleep:
            raise RuntimeError(f"simulated engine {self.index} got request {req.request_id} while asleep")
        seq = trajectory(req)
        if not isinstance(req.output_ids, Runs):  # (simulated tokens are kept as runs: reflow.sim.runs)
            req.output_ids, req.versions = Runs(req.output_ids), Runs(req.versions)
        seq.request, seq.prompt_tokens, seq.generated = req, len(req.prompt_ids), len(req.output_ids)
        seq.group = req.meta["group"]
        seq.prompt_full_blocks, seq.prompt_rest = divmod(seq.prompt_tokens, self.block_size)
        if seq.remaining <= 0:
            raise ValueError(f"request {req.request_id} has no tokens left to generate")
        seq.needs_prefill = seq.prompt_tokens + seq.generated
        self.active[req.request_id] = req
        (self.in_tool if seq.resume_at > self.clock else self.waiting).append(seq)

    def resume(self, held: Iterable[Request]) -> None:
        for req in held:
            self.add(req)

    def step(self) -> list[Request]:
        """One macro-step, not past ``until``; returns the requests that finished. With nothing to run (every
        sequence at its tool) the engine idles to the first tool's return, or ``until``."""
        return self._step(self.max_steps, macro_s=self.macro_s)

    def step_until_started(self) -> tuple[list[Request], list[int]]:
        """Single decode steps until every request in flight has a token (``RolloutEngine.step_until_started``);
        a sequence at its tool has tokens already. Returns what finished and the sequences of each step."""
        finished: list[Request] = []
        sequences: list[int] = []
        while any(not req.output_ids for req in self.active.values()):
            sequences.append(self.num_active)
            finished += self._step(1, ignore_until=True)
        return finished, sequences

    def hold_all(self) -> list[Request]:
        """Stop everything in flight, keeping each request's tokens (to resume here or on another engine)."""
        held = list(self.active.values())
        self.running, self.waiting, self.in_tool = [], [], []
        self.active = {}
        return held

    def abort(self, request_id: str) -> Request | None:
        """Stop one request, keeping its tokens (``RolloutEngine.abort``)."""
        req = self.active.pop(request_id, None)
        if req is not None:
            seq = trajectory(req)
            self.running, self.waiting, self.in_tool = (
                [s for s in queue if s is not seq] for queue in (self.running, self.waiting, self.in_tool))
        return req

    def holding_kv(self) -> list[Request]:
        """The sequences holding KV blocks (running, and at their tool: the simulator keeps those in the cache)."""
        return [seq.request for seq in self.running + self.in_tool]

    def load_weights(self, named_tensors, version: int) -> float:
        """A weight sync under the requests in flight (``RolloutEngine.load_weights``): the running ones are
        preempted to the head of the queue, in order, and each sequence holding KV prefills its prompt and
        prefix again when it next runs; queued ones are untouched. Later tokens carry ``version``."""
        for seq in self.running + self.in_tool:
            seq.needs_prefill = seq.prompt_tokens + seq.generated
        self.waiting[:0] = self.running
        self.running = []
        self.version = version
        self.asleep = False
        return 0.0

    def sleep(self) -> None:
        """Free the engine's memory for the trainer (``change_placement``, a rank joining it): its worker held
        everything in flight before, so a request still here would be lost."""
        if self.active:
            raise RuntimeError(
                f"simulated engine {self.index} put to sleep with {len(self.active)} requests in flight"
            )
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False

    # ---- the simulated clock -------------------------------------------------------------

    def wait_until(self, moment: float) -> None:
        """Idle to ``moment`` (a weight sync's barrier, a placement change, a command arriving)."""
        if moment > self.clock:
            self.idle_s += moment - self.clock
            self.clock = moment

    def next_wakeup(self) -> float | None:
        """When a sequence waiting on its tool comes back (None if none is)."""
        return min((seq.resume_at for seq in self.in_tool), default=None)

    # ---- scheduling ----------------------------------------------------------------

    def _schedule(self) -> None:
        back = [seq for seq in self.in_tool if seq.resume_at <= self.clock]
        if back:
            self.in_tool = [seq for seq in self.in_tool if seq.resume_at > self.clock]
            self.running.extend(back)
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            if not self._fits(self.running + self.in_tool + self.waiting[:1], extra=1):
                break
            self.running.append(self.waiting.pop(0))

    def _step(self, max_steps: int, ignore_until: bool = False, macro_s: float = 0.0) -> list[Request]:
        until = float("inf") if ignore_until else self.until
        self.decode_steps = 0
        self._schedule()
        while not self.running and self.waiting and not self.in_tool:
            # nothing fits even alone: run the oldest waiting sequence anyway (vLLM would too)
            self.running.append(self.waiting.pop(0))
        if not self.running:
            wake = self.next_wakeup()
            self.wait_until(until if wake is None else min(until, wake))
            return []
        # one pass: the macro-step's length (no sequence passes its end or its next tool call), the prefill it
        # owes and the context it reads
        steps, prefill, context = 1 << 62, 0, 0
        for seq in self.running:
            remaining = seq.target_tokens - seq.generated
            if remaining < steps:
                steps = remaining
            for point in seq.turn_points:  # (empty without tool turns)
                if point > seq.generated:
                    steps = min(steps, point - seq.generated)
                    break
            prefill += seq.needs_prefill
            context += seq.prompt_tokens + seq.generated
        longest = max_steps
        if macro_s > 0.0:  # a small batch's short steps: as many as fill ``macro_s``
            longest = max(max_steps, int(macro_s / self.profile.step_seconds(len(self.running), context)))
        steps = min(steps, longest)
        # the cache: shorten the macro-step, or preempt the newest sequence when even one step overflows
        at_tool = sum(seq.prompt_tokens + seq.generated for seq in self.in_tool)
        while not self._fits(self.running + self.in_tool, steps, tokens=context + at_tool):
            if steps > 1:
                steps = max(1, steps // 2)
                continue
            victim = self.running.pop()
            context -= victim.prompt_tokens + victim.generated
            prefill -= victim.needs_prefill
            victim.needs_prefill = victim.prompt_tokens + victim.generated
            self.waiting.insert(0, victim)
            self.preemptions += 1
            if not self.running:
                return []
        n = len(self.running)
        in_flight = len(self.active)
        profile = self.profile
        seconds = steps * profile.step_seconds(n, context) + profile.context_token_s * n * steps * (steps - 1) / 2
        seconds += prefill * profile.prefill_token_s
        tick = profile.worker_tick_s  # the worker's own seconds per decode step: on the clock, not busy
        if self.clock + seconds + steps * tick > until and steps > 1:
            fit = max(1, int(steps * (until - self.clock) / (seconds + steps * tick)))
            seconds *= fit / steps
            steps = fit
        # one pass over the running sequences: their tokens and versions (``Request.append_model_tokens``, inlined:
        # the simulator's hottest loop; simulated tokens have no log-probs, and every one is the model's, so
        # ``model_spans`` is not kept), the KV blocks the step held (``_blocks``), and who finished or calls a tool
        version = self.version
        shared: dict[str, int] = {}
        blocks = sum(self._own_blocks(seq, shared) for seq in self.in_tool)
        kept_shared = dict(shared)  # the blocks held after the step, by the sequences that stay (``kv_usage``)
        kept = blocks
        finished, tool, running = [], [], []
        block_size = self.block_size
        for seq in self.running:
            req = seq.request
            # ``Runs.grow``, inlined: the ids are 0 and the versions change only at a sync, so both are one run
            ids, versions = req.output_ids, req.versions
            if ids.values and ids.values[-1] == 0:
                ids.ends[-1] += steps
            else:
                ids.ends.append((ids.ends[-1] if ids.ends else 0) + steps)
                ids.values.append(0)
            if versions.values and versions.values[-1] == version:
                versions.ends[-1] += steps
            else:
                versions.ends.append((versions.ends[-1] if versions.ends else 0) + steps)
                versions.values.append(version)
            generated = seq.generated = seq.generated + steps
            seq.needs_prefill = 0
            shared[seq.group] = seq.prompt_full_blocks  # ``_own_blocks``, inlined
            own = -(-(seq.prompt_rest + generated) // block_size)
            blocks += own
            if generated < seq.target_tokens:
                kept += own
                kept_shared[seq.group] = seq.prompt_full_blocks
            if generated >= seq.target_tokens:
                req.finish_reason = "length" if seq.generated >= req.max_tokens else "stop"
                del self.active[req.request_id]
                finished.append(req)
            elif seq.turn_points and seq.generated in seq.turn_points:
                seq.resume_at = self.clock + seconds + seq.tool_latency_s
                req.tool_calls += 1
                req.tool_s += seq.tool_latency_s
                tool.append(seq)
            else:
                running.append(seq)
        blocks += sum(shared.values())
        kept += sum(kept_shared.values())
        self.prefilled_tokens += prefill
        budget = max(self.budget_blocks, 1)
        usage = min(1.0, blocks / budget)  # what the step held, before the finished leave
        self.kv_usage_sum += usage * steps
        self.clock += seconds + steps * tick
        self.busy_s += seconds
        self.decode_steps = steps
        self.engine_steps += steps
        self.step_sequences += in_flight * steps
        self.sampled_tokens += n * steps
        self.running = running
        self.in_tool.extend(tool)
        self.signals = self._signals(min(1.0, kept / budget))  # after the finished left: ``kv_usage()``
        return finished
