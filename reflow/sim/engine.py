"""A simulated rollout engine: continuous batching over a paged KV cache, as vLLM's V1 scheduler does it.

Each engine has its own clock and advances in *macro-steps* of up to ``max_steps`` decode steps (fewer if a
sequence finishes, a tool call starts or the cache would overflow first), each costed by the profile. The
scheduler moves waiting sequences (new, or preempted) into the running set while the KV cache has blocks
and the running set has room; when a running sequence needs a block that is not there, the newest running
sequence is preempted (its blocks freed; it waits and its prefix is recomputed, costed as prefill). A group's
prompt blocks that are full are shared by its sequences (the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reflow.sim.profiles import CostProfile


@dataclass
class SimSequence:
    uid: str
    group: str
    draw: int
    prompt_tokens: int
    target_tokens: int
    birth_version: int
    origin: int
    generated: int = 0
    turn_points: list[int] = field(default_factory=list)
    """Response lengths at which the sequence calls its tool (and waits ``tool_latency_s`` for it)."""
    tool_latency_s: float = 0.0
    resume_at: float = 0.0
    needs_prefill: int = 0
    """Tokens to (re)compute when next scheduled."""
    admitted_at: float = 0.0
    """Simulated time it was admitted (for the admission-to-finish latency)."""

    @property
    def remaining(self) -> int:
        return self.target_tokens - self.generated


class SimEngine:
    def __init__(self, profile: CostProfile, index: int, max_steps: int = 32):
        self.profile = profile
        self.index = index
        self.max_steps = max_steps
        self.clock = 0.0
        self.paused_until = 0.0
        self.version = 0
        self.running: list[SimSequence] = []
        self.waiting: list[SimSequence] = []
        self.in_tool: list[SimSequence] = []
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.engine_steps = 0
        self.step_sequences = 0
        self.preemptions = 0
        self.kv_usage_sum = 0.0
        self.budget_blocks = profile.kv_budget_tokens // profile.kv_block_size

    # ---- KV accounting -----------------------------------------------------------

    def _blocks(self, sequences: list[SimSequence], extra: int = 0) -> int:
        """Blocks ``sequences`` hold after ``extra`` more tokens each (full prompt blocks shared per group)."""
        size = self.profile.kv_block_size
        shared: dict[str, int] = {}
        total = 0
        for seq in sequences:
            full, rest = divmod(seq.prompt_tokens, size)
            shared[seq.group] = full
            total += -(-(rest + seq.generated + extra) // size)
        return total + sum(shared.values())

    def kv_usage(self) -> float:
        return min(1.0, self._blocks(self.running + self.in_tool) / max(self.budget_blocks, 1))

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.in_tool)

    def context_tokens(self) -> int:
        return sum(seq.prompt_tokens + seq.generated for seq in self.running)

    # ---- scheduling ----------------------------------------------------------------

    def add(self, sequences: list[SimSequence]) -> None:
        for seq in sequences:
            seq.needs_prefill = seq.prompt_tokens
        self.waiting.extend(sequences)

    def reload_weights(self) -> None:
        """A weight sync: the live engine resets its prefix cache, so every sequence in flight prefills its prompt
        and generated prefix again when it next runs (partial rollouts keep their tokens)."""
        for seq in self.running + self.waiting:
            seq.needs_prefill = seq.prompt_tokens + seq.generated

    def hold_all(self) -> list[SimSequence]:
        """A placement change: stop everything in flight, keeping each sequence's tokens (to resume here or on
        another engine, which prefills its prompt and prefix again)."""
        held = self.running + self.waiting + self.in_tool
        self.running, self.waiting, self.in_tool = [], [], []
        for seq in held:
            seq.needs_prefill = seq.prompt_tokens + seq.generated
        return held

    def resume(self, sequences: list[SimSequence]) -> None:
        """Held sequences, from this engine or another: they wait to be scheduled, their prefill pending."""
        self.waiting.extend(sequences)

    def _schedule(self) -> None:
        back = [seq for seq in self.in_tool if seq.resume_at <= self.clock]
        if back:
            self.in_tool = [seq for seq in self.in_tool if seq.resume_at > self.clock]
            self.running.extend(back)
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            if self._blocks(self.running + self.in_tool + self.waiting[:1], extra=1) > self.budget_blocks:
                break
            self.running.append(self.waiting.pop(0))

    def next_wakeup(self) -> float | None:
        """When a sequence waiting on its tool comes back (None if none is)."""
        return min((seq.resume_at for seq in self.in_tool), default=None)

    def step(self, until: float) -> list[SimSequence] | None:
        """One macro-step starting at ``max(clock, paused_until)``, not past ``until``. Returns the sequences
        that finished, or None when there was nothing to run (the engine idles to ``until`` or its next tool
        return, whichever is first)."""
        start = max(self.clock, self.paused_until)
        if start > self.clock:
            self.idle_s += start - self.clock  # a weight sync held it
            self.clock = start
        self._schedule()
        while not self.running and self.waiting and not self.in_tool:
            # nothing fits even alone: run the oldest waiting sequence anyway (vLLM would too)
            self.running.append(self.waiting.pop(0))
        if not self.running:
            wake = self.next_wakeup()
            target = until if wake is None else min(until, wake)
            if target > self.clock:
                self.idle_s += target - self.clock
                self.clock = target
            return None
        steps = min(self.max_steps, min(seq.remaining for seq in self.running))
        for seq in self.running:
            upcoming = [point - seq.generated for point in seq.turn_points if point > seq.generated]
            if upcoming:
                steps = min(steps, min(upcoming))
        # the cache: shorten the macro-step, or preempt the newest sequence when even one step overflows
        while self._blocks(self.running + self.in_tool, extra=steps) > self.budget_blocks:
            if steps > 1:
                steps = max(1, steps // 2)
                continue
            victim = self.running.pop()
            victim.needs_prefill = victim.prompt_tokens + victim.generated
            self.waiting.insert(0, victim)
            self.preemptions += 1
            if not self.running:
                return []
        prefill = sum(seq.needs_prefill for seq in self.running)
        for seq in self.running:
            seq.needs_prefill = 0
        n, context = len(self.running), self.context_tokens()
        profile = self.profile
        seconds = steps * profile.step_seconds(n, context) + profile.context_token_s * n * steps * (steps - 1) / 2
        seconds += prefill * profile.prefill_token_s
        if self.clock + seconds > until and steps > 1:
            fit = max(1, int(steps * (until - self.clock) / seconds))
            seconds *= fit / steps
            steps = fit
        for seq in self.running:
            seq.generated += steps
        self.kv_usage_sum += self.kv_usage() * steps
        self.clock += seconds
        self.busy_s += seconds
        self.engine_steps += steps
        self.step_sequences += n * steps
        finished = [seq for seq in self.running if seq.remaining <= 0]
        tool = [seq for seq in self.running if seq.remaining > 0 and seq.generated in seq.turn_points]
        for seq in tool:
            seq.resume_at = self.clock + seq.tool_latency_s
        self.running = [seq for seq in self.running if seq.remaining > 0 and seq not in tool]
        self.in_tool.extend(tool)
        return finished
