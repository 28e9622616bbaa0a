"""One rollout rank of a decoupled run: admit groups, step the engine, route finished groups, obey commands.

    loop  1. commands     take what trainer rank 0 sent (only here, never inside an engine step):
                            SyncWeights(v)  (one_step_off: step until every admitted request has its first
                                            token) join the weight sync: the engine reloads under the
                                            requests in flight, and those holding KV prefill their prefix
                                            again under version v (partial rollouts; a request without a
                                            token starts under v)
                            Progress        hand the trainer's counts (and, with the global dispatcher,
                                            this rank's grants) to the dispatch budget, and the shards'
                                            unused counts to the router
                            Transition(n)   hold what is in flight as partial rollouts (``HeldGroup``) and
                                            leave: the placement change hands them to the new placement's
                                            rollout workers, which resume them first
                            Stop            drop what is in flight and leave
          2. admit        whole groups, while the dispatch budget has room and the admission gate lets the
                          next one in (``reflow.rollout.admission``: the concurrency cap, and with
                          scheduler.kv_admission the KV rule, both counting the trajectories waiting on a
                          tool; a worker with nothing in flight always admits); also right after each
                          Progress, before the next command
          3. generate     one engine step (``reflow.rollout.turns``: a trajectory that calls a tool waits for its
                          environment off the engine, and re-enters it with the answer); a finished group is
                          stamped with the engine version it finished at, scored, bound to the trainer shard
                          the router picks (``reflow.scheduler.routing``) and put on the data outbox at once
                          (the send happens on the outbox thread)
          4. idle         nothing in flight: block on the control inbox until a command arrives

one_step_off's first-token rule (``ModeSettings.first_tokens_before_sync``) makes a sample's birth version (its
oldest token) equal to the version it was admitted under, which its exactness needs. async and reflow skip
it: a request with no token yet waits in the engine's queue across the sync and starts under the new weights,
later and fresher, never staler, as a group the gate holds back does; so the trainers never wait on those
prefill steps at a sync.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from reflow.dataplane.protocols import CommandSource, DataSink
from reflow.metrics.timeline import NullTimeline, Timeline
from reflow.rollout.admission import AdmissionGate
from reflow.rollout.protocols import Engine, GroupScorer, GroupSource, WeightReceiver
from reflow.rollout.request import Request
from reflow.rollout.turns import RolloutDriver
from reflow.scheduler import DispatchBudget
from reflow.scheduler.routing import ShardRouter
from reflow.types import (
    Command,
    EvalShare,
    GroupDone,
    HeldGroup,
    Progress,
    Sample,
    SampleStage,
    Stop,
    SyncWeights,
    Transition,
    WorkerStats,
)


def apply_progress(progress: Progress, budget: DispatchBudget, router: ShardRouter) -> None:
    """A Progress word: the trainer's counts (and the grants, with the global dispatcher) to the dispatch
    budget, the shards' unused counts to the router. Cumulative counts: a late or repeated word is harmless."""
    budget.update(progress.steps_done, progress.retired, progress.filtered)
    if progress.granted is not None:
        budget.grant(progress.granted)
    router.update(progress.shard_unused)


class GroupAssembler:
    """Collects a group's finished requests; the last one completes the group, which is then scored."""

    def __init__(self, scorer: GroupScorer, group_size: int, origin: int):
        self.scorer = scorer
        self.group_size = group_size
        self.origin = origin
        self.partial: dict[str, list[Request]] = {}

    def add(self, req: Request, version: int) -> list[Sample] | None:
        """``version``: the engine's, now; the group's finish version when ``req`` completes it."""
        members = self.partial.setdefault(req.meta["group"], [])
        members.append(req)
        if len(members) < self.group_size:
            return None
        del self.partial[req.meta["group"]]
        samples = self.scorer.score(members)
        # a group handed over at a placement change counts against no budget of the new placement (R1)
        origin = -1 if any(member.meta.get("carried") for member in members) else self.origin
        for sample in samples:
            sample.origin = origin
            sample.finish_version = version
        return samples

    def waiting_ids(self) -> list[str]:
        """Finished requests whose group is not complete yet."""
        return [req.request_id for members in self.partial.values() for req in members]


class RolloutWorker:
    """One rollout rank for one placement: ``run`` returns the command that ended it (Stop or Transition).

    It is written against protocols only (``Engine``, ``GroupSource``, ``GroupScorer``, ``WeightReceiver``,
    ``CommandSource``, ``DataSink``) and a clock: the live rank runs it over vLLM and the gloo planes on the
    wall clock, the simulator over simulated engines and in-process queues on its own clock, one ``tick`` at a
    time (a tick is one pass of the loop above)."""

    def __init__(
        self,
        engine: Engine,
        turns: RolloutDriver,
        groups: GroupSource,
        scorer: GroupScorer,
        weight_sync: WeightReceiver,
        control: CommandSource,
        outbox: DataSink,
        budget: DispatchBudget,
        gate: AdmissionGate,
        rollout_index: int,
        trainer_ranks: list[int],
        evaluate: Callable[[int], tuple[float, int]] | None = None,
        eval_interval: int = 0,
        evaluate_first: bool = False,
        carried: list[HeldGroup] | None = None,
        clock: Callable[[], float] = time.time,
        report_interval_s: float = 1.0,
        first_tokens_before_sync: bool = False,
        timeline: "Timeline | NullTimeline | None" = None,
    ):
        self.rollout_index = rollout_index
        self.engine = engine
        self.turns = turns
        self.groups_source = groups
        self.evaluate = evaluate
        """This worker's share of the held-out evaluation of the engine's policy: (sum of rewards, samples)."""
        self.eval_interval = eval_interval
        """metrics.eval_interval: the versions ``evaluate`` scores (those it divides; 0: none)."""
        self.weight_sync = weight_sync
        self.trainer_ranks = trainer_ranks
        self.control, self.outbox, self.budget = control, outbox, budget
        self.clock = clock
        self.router = ShardRouter(len(trainer_ranks), first=rollout_index)
        self.gate = gate
        """Admission (the concurrency cap and the KV rule), over this worker's engine and turns."""
        self.group_size = gate.group_size
        self.groups = GroupAssembler(scorer, self.group_size, rollout_index)
        self.stats = WorkerStats()  # this window's times (the gate keeps its own counts)
        self.last_report = clock()
        self.report_interval_s = report_interval_s
        """Seconds between its reports (WorkerStats) to the leader."""
        self.first_tokens_before_sync = first_tokens_before_sync
        """one_step_off: step until every admitted request has a token before holding them (I1)."""
        self._next_group: tuple | None = None  # ((draw, version), its requests) while it waits on the gate
        self.commands: deque = deque()
        self.evaluate_first = evaluate_first
        """Evaluate the engine's policy before generating anything (a new run's starting policy)."""
        self.carried_in = list(carried or [])
        """Partial rollouts of the previous placement this worker resumes before anything else."""
        self.carried_out: list[HeldGroup] = []
        """What it held when a placement change ended it (``run`` returned Transition)."""
        self.ledger: dict = {"started": [], "sent": [], "dropped_at_stop": [], "handed_in": [], "handed_out": []}
        self.timeline = timeline or NullTimeline()
        """Where the worker's spans go (generate, idle, sync, evaluate): ``reflow.metrics.timeline``, on the wall
        clock; the simulator's has none."""

    def run(self) -> Command:
        self.start()
        while True:
            ended = self.tick()
            if ended is not None:
                return ended

    def start(self) -> None:
        """Before the loop: resume the partial rollouts handed over, evaluate a new run's starting policy."""
        self._resume_carried()
        if self.evaluate_first:
            self._evaluate(self.engine.version)

    def tick(self) -> Command | None:
        """One pass of the loop: the command that ends the worker (Stop, Transition), or None."""
        ended = self.take_commands()
        if ended is None:
            self.work()
        return ended

    def take_commands(self) -> Command | None:
        """1. commands, in the order sent; returns the one that ends the worker, if one came."""
        self.commands.extend(self.control.poll())
        progressed = False  # Progress words applied and not admitted on yet (a run of them admits once)
        while self.commands:
            command = self.commands.popleft()
            if isinstance(command, Progress):
                apply_progress(command, self.budget, self.router)
                progressed = True
                continue
            if progressed:  # on the weights of now, before a SyncWeights (or a leaving) behind them applies
                self._admit()
                progressed = False
            if isinstance(command, Stop):
                self.ledger["dropped_at_stop"] = [req.request_id for req in self.turns.drop_all()]
                self.ledger["dropped_at_stop"] += self.groups.waiting_ids()
                self._tell_followers("leave", command)
                return command
            if isinstance(command, Transition):
                self.carried_out = self._hold_for_transition()
                self._tell_followers("leave", command)
                return command
            if isinstance(command, SyncWeights):
                self._sync(command.version)
            else:
                raise TypeError(f"unknown control command {command!r}")
        if progressed:
            self._admit()
        return None

    def work(self) -> None:
        """2. admit, then 3. one engine step, or 4. idle until a command arrives; report every ``report_interval_s``."""
        self._admit()
        start = self.clock()
        if self.turns.num_active:
            with self.timeline.span("generate"):
                self._step()
            self._count_busy(self.clock() - start)
        else:
            with self.timeline.span("idle"):
                command = self.control.wait(timeout=0.05)
            self.stats.idle_s += self.clock() - start
            if command is not None:
                self.commands.append(command)
        if self.clock() - self.last_report > self.report_interval_s:
            self._report()

    def _tell_followers(self, *call) -> None:
        """A tensor-parallel engine's other ranks make the same calls (``reflow.rollout.tensor_parallel``)."""
        if self.engine.mirror is not None:
            self.engine.mirror.publish(*call)

    def _count_busy(self, elapsed: float) -> None:
        """Time spent stepping: engine time, less what the turn driver spent waiting on tools in it."""
        waited = self.turns.take_tool_wait()
        self.stats.busy_s += elapsed - waited
        self.stats.tool_wait_s += waited

    def _hold_for_transition(self) -> list[HeldGroup]:
        """A placement change: hold everything in flight as partial rollouts, to hand to the new placement's
        rollout workers (the change costs its mechanism, not a drain of the longest answers).

          1. one_step_off: step until every admitted request has its first token (I1, as before a weight sync)
          2. hold the engine's requests with their prefix (a request without a token is held empty)
          3. trajectories at their environment (a tool call, or scoring) come back within its time limit: step
             until none is left there, holding each one that re-enters the engine
          4. every group with a held request, with its members that already finished"""
        t0 = self.clock()
        self._first_tokens()
        held = self.turns.hold_all()
        while self.turns.num_waiting_on_tools or self.turns.scoring:
            for req in self.turns.step():
                self._finished(req)
            held += self.turns.hold_all()
        self._count_busy(self.clock() - t0)
        groups: dict[str, HeldGroup] = {}
        for req in held:
            group = req.meta["group"]
            groups.setdefault(group, HeldGroup(group, [], self.groups.partial.pop(group, [])))
            groups[group].held.append(req)
        assert not self.groups.partial, "a group's unfinished members are all held"
        carried = list(groups.values())
        self.ledger["handed_out"] += [rid for group in carried for rid in group.request_ids]
        self._report()
        return carried

    def _resume_carried(self) -> None:
        """The partial rollouts handed to this worker: back into the engine with their prefix (prefilled again),
        their finished members back with the group assembler; they count against no budget (origin -1)."""
        for group in self.carried_in:
            for req in group.held + group.finished:
                req.meta["carried"] = True
            if group.finished:
                self.groups.partial[group.group_id] = list(group.finished)
            self.stats.prefilled_tokens += sum(len(req.prompt_ids) + len(req.output_ids) for req in group.held)
            self.turns.resume(group.held)
            self.ledger["handed_in"] += group.request_ids
        self.carried_in = []

    def _first_tokens(self) -> None:
        """one_step_off only (I1): step until every admitted request has a token, so every token of an admitted
        request comes from its admission version on. async and reflow hold a request without a token as it is."""
        if not self.first_tokens_before_sync:
            return
        finished, step_sequences = self.turns.step_until_started()
        self.gate.after_steps([len(req.output_ids) for req in finished], step_sequences)
        for req in finished:
            self._finished(req)

    def _sync(self, version: int) -> None:
        with self.timeline.span("sync", version=version):
            self._reload_under_requests(version)

    def _reload_under_requests(self, version: int) -> None:
        """A weight sync: 1. one_step_off: step until every admitted request has its first token, 2. load version
        v under the requests in flight: those holding KV are preempted by the reload and prefill their prompt
        and prefix again under v (partial rollouts: each token keeps the version that sampled it), queued ones
        wait on untouched, 3. evaluate v (at an interval; the engine is emptied first and refilled after: the
        evaluation runs on an engine of its own requests). Nothing leaves the engine otherwise: taking every
        request out and adding it back cost the worker a submission per request in flight, queued ones included,
        at every sync. An engine that pins versions (a LoRA run's adapters) preempts nothing: the requests in
        flight finish on the adapter they started on, and only new ones take v."""
        t0 = self.clock()
        if not self.engine.pins_versions:
            self._first_tokens()
        held = self.turns.hold_all() if self._evaluates(version) else []  # trajectories at a tool stay there
        reloaded = [] if self.engine.pins_versions else self.engine.holding_kv()
        self._count_busy(self.clock() - t0)
        self._tell_followers("sync", version)
        t1 = self.clock()
        self.weight_sync.sync(None, self.engine, version)
        synced = self.clock() - t1
        self._evaluate(version)
        # prefilled again under v: the prompt and prefix of every request the reload preempted or the evaluation
        # held (the reload reset the prefix cache)
        again = held + reloaded
        self.stats.prefilled_tokens += sum(len(req.prompt_ids) + len(req.output_ids) for req in again)
        self.stats.held_at_sync += len(again)
        t2 = self.clock()
        self.turns.resume(held)
        self.stats.sync_s += synced + self.clock() - t2
        self.stats.syncs += 1
        self._report()

    def _evaluates(self, version: int) -> bool:
        return self.evaluate is not None and bool(self.eval_interval) and version % self.eval_interval == 0

    def _evaluate(self, version: int) -> None:
        """metrics.eval_interval: after a weight sync to a version it divides, this rank's share of the held-out
        prompts, one sample each at the rollout temperature, with the engine holding nothing else (the partial
        rollouts wait until it is done): a measure of exactly policy ``version``. The trainer does not wait
        for it; trainer rank 0 logs the mean once every rollout rank's share has arrived."""
        if not self._evaluates(version):
            return
        t0 = self.clock()
        with self.timeline.span("evaluate", version=version):
            total, count = self.evaluate(version)
        self.stats.busy_s += self.clock() - t0
        self.outbox.put(self.control.leader, EvalShare(version, total, count))

    def _step(self) -> None:
        sequences = self.engine.num_active
        finished = self.turns.step()
        if self.turns.stepped:  # (else it waited on a tool: no engine signal to learn from)
            self.gate.after_step([len(req.output_ids) for req in finished], sequences)
        for req in finished:
            self._finished(req)

    def _admit(self) -> None:
        """Start whole groups while the dispatch budget has room and the admission gate (the concurrency cap, and
        the KV rule when on) lets the next one in."""
        while True:
            if not self.budget.can_start():  # R1: the window (and in reflow B_max)
                return
            key = (self.groups_source.peek(), self.engine.version)  # the seeds follow the version it starts under
            if self._next_group is None or self._next_group[0] != key:
                self._next_group = key, self.groups_source.requests(*key)
            requests = self._next_group[1]
            if not self.gate.allows(len(requests[0].prompt_ids)):
                return  # it waits for the next step (trajectories are in flight, in the engine or at a tool:
                # the gate admits anything when nothing is)
            self.groups_source.take()
            self._next_group = None
            now = self.clock()
            for req in requests:
                req.meta.update(admitted_at=now)
                self.turns.add(req)
                self.stats.prefilled_tokens += len(req.prompt_ids)
                self.ledger["started"].append(req.request_id)
            self.budget.record_start()

    def _finished(self, req: Request) -> None:
        samples = self.groups.add(req, self.engine.version)
        if samples is None:
            return
        destination = self.trainer_ranks[self.router.choose(len(samples))]  # R4: bound to a shard on arrival
        for sample in samples:  # (before the put: the outbox's thread may send them at once)
            sample.enter(SampleStage.SENT)
        self.outbox.put(destination, GroupDone(samples))
        now = self.clock()
        self.ledger["sent"].extend(
            {"uid": s.uid, "to": destination, "admitted_at": req.meta["admitted_at"], "finished_at": now,
             "response_len": len(s.output_ids), "finish_version": s.finish_version}
            for s in samples
        )

    def _report(self) -> None:
        window = self.stats + self.gate.report()  # (a new WorkerStats: its load is set, nothing else is shared)
        window.load = self.gate.load(started=self.budget.started)
        self.outbox.put(self.control.leader, window)
        self.stats = WorkerStats()
        self.last_report = self.clock()

