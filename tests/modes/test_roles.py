"""The decoupled protocol's roles driven in process, without vLLM or torchrun: trainer shards, the leader and
the rollout side's ``apply_progress``, wired as ``DecoupledMode`` wires them (readiness exchange, moves,
Progress), so each rule of ``docs/decoupled_protocol.md`` gets a fast test. The helpers' groups have been
sent (``SampleStage.SENT``): what a trainer shard receives."""

from collections import deque

import pytest

from reflow.distributed.placement import build_placement
from reflow.modes.leader import Leader, RolloutWindow
from reflow.modes.ledger import new_ledger
from reflow.modes.rollout_worker import apply_progress
from reflow.modes.trainer_role import Poll, TrainerRole
from reflow.modes.trainer_shard import TrainerShard
from reflow.modes.transition import ChangePlan
from reflow.replay import AcceptAll, RandomSampler, ReplayBuffer
from reflow.scheduler import DispatchBudget, DispatchRule
from reflow.scheduler.routing import ShardRouter
from reflow.types import (
    NEXT_STAGES,
    EvalShare,
    HeldGroup,
    InProcessExchange,
    Progress,
    Sample,
    SampleStage,
    SyncWeights,
    TrainerView,
    Transition,
    WorkerStats,
)

GROUP = 4


def group(draw: int, origin: int, finish_version: int, birth_version: int | None = None) -> list[Sample]:
    birth = finish_version if birth_version is None else birth_version
    return [
        Sample(uid=f"g{draw}/{k}", draw=draw, group_id=f"g{draw}", prompt_ids=[1], output_ids=[5] * (k + 1),
               logprobs=[-0.1] * (k + 1), versions=[birth] * (k + 1), reward=0.5, origin=origin, advantage=1.0,
               finish_version=finish_version, stage=SampleStage.SENT)
        for k in range(GROUP)
    ]


def shards(count: int, batch: int, num_rollout: int, sigma=0.5, delta=2) -> tuple[list[TrainerShard], dict]:
    ledger = new_ledger()
    out = []
    for index in range(count):
        buffer = ReplayBuffer(sigma, delta, RandomSampler(), AcceptAll(), seed=index, anchor="finish")
        buffer.start_version = 0
        out.append(TrainerShard(buffer, index, num_rollout, batch // count, ledger))
    return out, ledger


class Sink:
    """The leader's control channel, in process: every command, in order, per rollout worker."""

    def __init__(self):
        self.sent: dict[int, list] = {}

    def send(self, dst, command):
        self.sent.setdefault(dst, []).append(command)


def exchange(all_shards: list[TrainerShard], version: int) -> TrainerView:
    """The gloo exchange's result, computed in process from every shard's report."""
    return TrainerView.combine([shard.readiness(version) for shard in all_shards])


def test_a_shard_retires_stale_arrivals_at_once_and_counts_per_worker():
    (shard,), ledger = shards(1, 8, num_rollout=2, delta=2)
    shard.accept_group(group(0, origin=1, finish_version=0), version=3)  # staleness 3 > delta
    shard.accept_group(group(1, origin=0, finish_version=2), version=3)
    assert shard.retired == [0, GROUP] and len(shard.buffer.unused) == GROUP
    assert {ledger["eviction_causes"][u] for u in ledger["evicted_unused"]} == {"arrived_stale"}
    shard.evict_stale(5, "aged")  # the second group ages past delta in the buffer
    assert shard.retired == [GROUP, GROUP]
    assert shard.window.evicted == {"arrived_stale": GROUP, "aged": GROUP, "at_sync": 0, "no_signal": 0}


class ShardMover:
    """The in-process ``SampleMover``: a moved sample reaches its shard at once."""

    def __init__(self, all_shards: list[TrainerShard]):
        self.shards = all_shards

    def send(self, receiver, samples):
        self.shards[receiver].accept_moved(samples)


class RecordingBackend:
    """A ``TrainerBackend`` and ``WeightPublisher`` that record what the role asked, in order."""

    def __init__(self):
        self.calls = []

    def train(self, plans, version):
        self.calls.append(("train", version, [plan.size for plan in plans]))
        return {"trained": version}

    def publish(self, version):
        self.calls.append(("publish", version))


def role_over(all_shards, interval=1, board=None, first_use=None):
    backend = RecordingBackend()
    role = TrainerRole(all_shards, interval, InProcessExchange(), ShardMover(all_shards), backend, backend,
                       board=board, first_use=first_use)
    return role, backend


def test_a_batch_holds_exactly_b_over_shards_after_the_moves():
    """Two shards, b = 8 (4 each), sigma 0.5: all three groups went to shard 0. The role's poll plans moves,
    shard 1 receives what it lacks, the next poll finds both ready, and the step trains exactly 4 on each,
    earliest deadline first (R3, R4)."""
    pair, ledger = shards(2, 8, num_rollout=1)
    for draw, finished in ((0, 1), (2, 1), (1, 0)):  # g1 arrives last but finished first
        pair[0].accept_group(group(draw, origin=0, finish_version=finished), version=1)
    view = exchange(pair, 1)
    assert not view.all_ready and view.unused == (12, 0)
    role, backend = role_over(pair)
    assert role.poll(1, steps_done=1) is Poll.MOVING
    assert role.poll(1, steps_done=1) is Poll.READY
    done = role.step(1, step=2)
    assert [plan.size for plan in done.plans] == [4, 4]
    assert backend.calls == [("train", 1, [4, 4]), ("publish", 2)]
    assert (done.trained_version, done.version, done.synced, done.stats) == (1, 2, True, {"trained": 1})
    assert sorted(ledger["moved_out"]) == sorted(ledger["moved_in"])
    trained_first = {s.group_id for s in done.fresh}
    assert "g1" in trained_first  # earliest deadline first, not arrival order: g1 finished at version 0
    assert sum(shard.retired[0] for shard in pair) == 8
    assert [entry["step"] for entry in ledger["consumed"]] == [2] * 8


def test_each_sample_moves_through_its_lifecycle_and_no_other_way():
    """Every move the roles make is one ``NEXT_STAGES`` allows, and the roles make every move it lists: two
    shards, b = 8, sigma 0.5, delta 2. Received on shard 0, moved to shard 1, trained, replayed, retired as it
    ages; evicted on arrival; handed over at a placement change; a sample never sent cannot be received."""
    pair, _ = shards(2, 8, num_rollout=1)
    seen: set[tuple[SampleStage, SampleStage]] = set()
    tracked: dict[str, SampleStage] = {}

    def observe(samples):
        for s in samples:
            before = tracked.get(s.uid, SampleStage.SENT)
            if before is not s.stage:
                seen.add((before, s.stage))
            tracked[s.uid] = s.stage

    groups = [group(draw, origin=0, finish_version=1) for draw in range(3)]
    everyone = [s for g in groups for s in g]
    for g in groups:
        pair[0].accept_group(g, version=1)
    observe(everyone)
    role, _ = role_over(pair, interval=2)
    assert role.poll(1, steps_done=1) is Poll.MOVING
    moved = [s for s in everyone if s in pair[1].buffer.unused]
    assert moved and {s.stage for s in moved} == {SampleStage.RECEIVED}
    seen.update({(SampleStage.RECEIVED, SampleStage.MOVED), (SampleStage.MOVED, SampleStage.RECEIVED)})
    assert role.poll(1, steps_done=1) is Poll.READY
    done = role.step(1, step=2)
    observe(everyone)
    assert {s.stage for s in done.fresh} == {SampleStage.TRAINED}
    # the next step: the 4 unused samples left and 4 replayed (sigma 0.5): a TRAINED sample trained again
    # stays TRAINED
    while role.poll(2, steps_done=2) is Poll.MOVING:
        pass
    again = role.step(2, step=3)
    assert again.plans[0].replayed or again.plans[1].replayed
    assert all(s.stage is SampleStage.TRAINED for plan in again.plans for s in plan.replayed)
    seen.add((SampleStage.TRAINED, SampleStage.TRAINED))
    observe(everyone)
    # a late group arrives past its bound; one in time is never trained and ages out with everything trained
    # at version 5 (delta 2)
    late, untrained = group(5, origin=0, finish_version=0), group(15, origin=0, finish_version=2)
    pair[0].accept_group(late, version=3)
    pair[0].accept_group(untrained, version=3)
    everyone += late + untrained
    observe(everyone)
    pair[0].evict_stale(5, "aged")
    pair[1].evict_stale(5, "aged")
    observe(everyone)
    assert {s.stage for s in late + untrained} == {SampleStage.EVICTED}
    # a placement change: shard 1 leaves and hands its buffer (unused and replayable samples) to shard 0
    for g in (group(6, origin=0, finish_version=5), group(7, origin=0, finish_version=5)):
        pair[1].accept_group(g, version=5)
        everyone += g
    pair[1].buffer.replayable.append(pair[1].buffer.unused.pop())  # one of them as if trained once and kept
    pair[1].buffer.replayable[-1].use_count, pair[1].buffer.replayable[-1].stage = 1, SampleStage.TRAINED
    tracked[pair[1].buffer.replayable[-1].uid] = SampleStage.TRAINED
    seen.add((SampleStage.RECEIVED, SampleStage.TRAINED))
    observe(everyone)
    samples, draws = pair[1].hand_over()
    observe(everyone)
    pair[0].accept_handover(samples, draws)
    observe(everyone)
    # the filter refuses a consumed sample: it retires at once
    pair[0].buffer.filter = type("RefuseAll", (), {"keep": staticmethod(lambda s: False)})()
    alone, _ = role_over([pair[0]])
    while alone.poll(5, steps_done=3) is not Poll.READY:
        arrived = group(10 + len(everyone), origin=0, finish_version=5)
        pair[0].accept_group(arrived, version=5)
        everyone += arrived
    last = alone.step(5, step=4)
    assert {s.stage for s in last.fresh} == {SampleStage.DROPPED}
    observe(everyone)
    allowed = {(a, b) for a, nexts in NEXT_STAGES.items() for b in nexts}
    from_shards = allowed - {(SampleStage.FINISHED, SampleStage.SENT)}  # (the rollout worker's move)
    assert seen <= allowed
    assert from_shards - seen == set(), f"moves the roles never made: {from_shards - seen}"
    # a sample that skips a stage is refused, naming it
    unsent = group(99, origin=0, finish_version=5)
    unsent[0].stage = SampleStage.FINISHED
    with pytest.raises(RuntimeError, match="g99/0: no move from finished to received"):
        pair[0].accept_group(unsent, version=5)


def test_the_role_syncs_only_at_sync_points_evicts_what_the_new_version_ages_and_runs_first_use_before_training():
    """Interval 2, delta 1, b = 4: the step from version 2 ends at version 3 (no sync), the one from 3 at 4 (a
    sync, after the group the new version ages past delta left as evicted "at_sync"); the first-use stage sees
    each step's fresh samples before the backend trains them; the leader hears the step's retirements."""
    (shard,), ledger = shards(1, 4, num_rollout=1, sigma=0.0, delta=1)
    seen = []
    sink = Sink()
    leader = Leader(sink, GROUP, controller=None)
    leader.enter([1], dispatcher=None)
    backend = RecordingBackend()
    first_use = lambda fresh: seen.append((len(fresh), len(backend.calls)))  # noqa: E731
    role = TrainerRole([shard], 2, InProcessExchange(), ShardMover([shard]), backend, backend, board=leader, first_use=first_use)
    shard.accept_group(group(0, origin=0, finish_version=2), version=2)
    shard.accept_group(group(1, origin=0, finish_version=2), version=2)
    shard.accept_group(group(2, origin=0, finish_version=1), version=2)  # the earliest deadline: trained first
    assert role.poll(2, steps_done=2) is Poll.READY
    done = role.step(2, step=3)
    assert (done.version, done.synced) == (3, False) and backend.calls == [("train", 2, [4])]
    assert role.poll(3, steps_done=3) is Poll.READY
    done = role.step(3, step=4)
    assert (done.version, done.synced) == (4, True)
    assert backend.calls[1:] == [("train", 3, [4]), ("publish", 4)]
    assert seen == [(4, 0), (4, 1)]  # four fresh samples each step, before that step's training
    # g2 at version 2, g0 at 3 (ties by arrival); g1, finished at 2, is two versions old at 4
    assert [{e["uid"].split("/")[0] for e in ledger["consumed"] if e["step"] == step} for step in (3, 4)] == [{"g2"}, {"g0"}]
    assert {u: ledger["eviction_causes"][u] for u in ledger["evicted_unused"]} == {f"g1/{k}": "at_sync" for k in range(GROUP)}
    assert sink.sent[1][-1].steps_done == 4  # the last Progress: after the second step


def test_the_leader_publishes_progress_only_when_it_changed_and_the_workers_apply_it():
    """The leader's Progress carries each worker's retired count and every shard's unused count; a rollout
    worker's budget and router take it through ``apply_progress``; a word that changes nothing is not sent."""
    pair, _ = shards(2, 8, num_rollout=2)
    sink = Sink()
    leader = Leader(sink, GROUP, controller=None)
    leader.enter([1, 2], dispatcher=None)
    pair[0].accept_group(group(0, origin=0, finish_version=0), version=0)
    pair[1].accept_group(group(1, origin=1, finish_version=0), version=0)
    pair[0].evict_stale(3, "aged")  # worker 0's group retires unused
    view = exchange(pair, 3)
    leader.publish(1, view)
    leader.publish(1, view)  # the same counts: nothing new to say
    assert [len(sink.sent[rank]) for rank in (1, 2)] == [1, 1]
    word = sink.sent[1][0]
    assert word == Progress(1, GROUP, None, (0, GROUP))
    rule = DispatchRule(window=16)
    budget, router = DispatchBudget(rule, 0, 2, GROUP), ShardRouter(2, first=0)
    before = budget.room()
    apply_progress(word, budget, router)
    assert budget.room() == before + GROUP  # the retired group freed its room in the window (R1)
    assert router.choose(GROUP) == 0  # the shard with fewer unused samples gets the next group


def test_worker_stats_add_up_and_the_window_repeats_the_last_ratio_when_a_step_has_no_report():
    window = RolloutWindow()
    window.add(1, WorkerStats(busy_s=3.0, idle_s=1.0, engine_steps=2, kv_usage_sum=1.0, cap=8, prefilled_tokens=40))
    window.add(1, WorkerStats(busy_s=1.0, idle_s=3.0, engine_steps=2, kv_usage_sum=0.6, cap=6, cap_changes=(("cut", 8, 6),)))
    row = window.close()
    assert row["rollout_idle_ratio"] == pytest.approx(0.5) and row["kv_usage_mean"] == pytest.approx(0.4)
    assert row["concurrency_caps"] == {"1": 6} and row["cap_changes"] == {"1": [("cut", 8, 6)]}
    assert row["rollout_prefilled_tokens"] == 40
    quiet = window.close()  # a step shorter than the report period
    assert quiet["rollout_idle_ratio"] == pytest.approx(0.5) and quiet["rollout_busy_s"] == 0.0


def test_an_evaluation_is_logged_once_every_worker_reported_it():
    leader = Leader(Sink(), GROUP, controller=None)
    leader.evaluations.expect(2, workers=2)
    leader.evaluations.add(EvalShare(2, 1.5, 3))
    assert leader.evaluations.finished() == {}
    leader.evaluations.add(EvalShare(2, 0.5, 1))
    assert leader.evaluations.finished() == {"eval_reward": pytest.approx(0.5), "eval_policy_version": 2}
    assert leader.evaluations.finished() == {}


def test_a_leaving_shard_hands_everything_over_and_budgets_restart():
    pair, ledger = shards(2, 8, num_rollout=2)
    pair[1].accept_group(group(0, origin=1, finish_version=0), version=0)
    samples, draws = pair[1].hand_over()
    pair[0].accept_handover(samples, draws)
    pair[0].restart_budgets(num_rollout=3)
    assert len(pair[0].buffer.unused) == GROUP and all(s.origin == -1 for s in pair[0].buffer.unused)
    assert pair[0].received_draws == {0} and pair[0].retired == [0, 0, 0]
    assert sorted(ledger["handed_over_unused"]) == sorted(ledger["handed_in_unused"])


def test_a_change_plan_says_who_joins_who_inherits_and_deals_the_held_groups():
    """T1x1+R3 -> T2x1+R2 and back (4 ranks, the trainer grows from rank 0 up): rank 1 joins the trainer and its
    worker's held groups go to the new workers holding the fewest sequences; staying workers keep their own;
    shrinking again, shard 1's buffer goes to shard 0 and rank 1's fresh worker takes nothing it did not hold."""
    grow = ChangePlan.to(build_placement(4, 1, 1, 3), replicas=2)
    assert (grow.old.name, grow.new.name) == ("T1x1+R3", "T2x1+R2")
    assert [grow.joins_trainer(rank) for rank in range(4)] == [False, True, False, False]
    assert not any(grow.leaves_trainer(rank) for rank in range(4))
    held = lambda name, sequences: HeldGroup(name, [None] * sequences, [])  # noqa: E731 - only the sizes matter
    dealt = grow.deal([[held("a", 3), held("b", 1)], [held("c", 2)], [held("d", 1)]])  # workers of ranks 1, 2, 3
    names = [[g.group_id for g in groups] for groups in dealt]
    assert names[0][0] == "c" and names[1][0] == "d"  # staying workers (ranks 2, 3) keep their own first
    assert sorted(n for groups in names for n in groups) == ["a", "b", "c", "d"]
    assert "a" in names[1]  # the largest leaving group goes to the worker holding fewer sequences
    shrink = ChangePlan.to(grow.new, replicas=1)
    assert [shrink.leaves_trainer(rank) for rank in range(4)] == [False, True, False, False]
    assert shrink.heir(1) == 0 and shrink.joins_trainer(1) is False
    assert [[g.group_id for g in groups] for groups in shrink.deal([[held("e", 1)], [held("f", 1)]])] == [[], ["e"], ["f"]]


def test_the_gloo_planes_and_the_in_process_fakes_implement_the_transport_protocols():
    from reflow.dataplane.protocols import CommandSink, CommandSource, DataSink
    from reflow.dataplane.transport import ControlChannel, Outbox
    from reflow.sim.system import SimControl, SimOutbox, WorkerControl

    for cls, protocol in ((ControlChannel, CommandSink), (ControlChannel, CommandSource), (Outbox, DataSink)):
        assert all(callable(getattr(cls, name, None)) for name in ("send", "poll", "wait", "put") if hasattr(protocol, name))
    assert isinstance(Sink(), CommandSink) and isinstance(SimControl(None), CommandSink)
    assert isinstance(WorkerControl(deque()), CommandSource) and isinstance(SimOutbox(None, 0), DataSink)


def test_the_vllm_engine_and_the_simulated_one_implement_the_engine_protocol():
    from reflow.rollout.engine import RolloutEngine
    from reflow.rollout.protocols import Engine
    from reflow.sim.engine import SimEngine
    from reflow.sim.profiles import TINY_CPU

    assert isinstance(SimEngine(TINY_CPU, 0), Engine)
    methods = ("add", "step", "step_until_started", "hold_all", "holding_kv", "resume", "load_weights", "sleep",
               "wake_up")
    assert all(callable(getattr(RolloutEngine, name, None)) for name in methods)
    assert RolloutEngine.decode_steps == 1 and isinstance(RolloutEngine.num_active, property)


def test_the_turn_driver_and_the_agent_driver_implement_the_rollout_driver_protocol():
    """The worker drives either; each member the protocol names exists on both, with the protocol's return type
    (an agent run in one_step_off crashed at its first sync when one driver kept an old return)."""
    import inspect

    from reflow.rollout.turns import RolloutDriver, SteppedDriver, TurnDriver
    from reflow.serving.agents import AgentDriver

    members = {
        name: value for cls in (RolloutDriver, SteppedDriver) for name, value in vars(cls).items()
        if not name.startswith("_")
    }
    members.update(dict.fromkeys(RolloutDriver.__annotations__ | SteppedDriver.__annotations__))
    assert {"step", "step_until_started", "hold_all", "scoring", "engine"} <= set(members)
    for driver in (TurnDriver, AgentDriver):
        source = inspect.getsource(driver.__init__)
        for name, value in members.items():
            if value is None:  # an attribute: set by the constructor, or a property
                assert f"self.{name}" in source or isinstance(getattr(driver, name, None), property), (driver.__name__, name)
            elif isinstance(value, property):
                assert isinstance(getattr(driver, name, None), property), (driver.__name__, name)
            else:
                got = inspect.signature(getattr(driver, name)).return_annotation
                assert got == inspect.signature(value).return_annotation, (driver.__name__, name, got)


class ScriptedControl:
    """A rollout worker's command source in process: what the test appends, in order."""

    leader = -1

    def __init__(self):
        self.queue = deque()

    def poll(self):
        commands = list(self.queue)
        self.queue.clear()
        return commands

    def wait(self, timeout=None):
        return self.queue.popleft() if self.queue else None


class Collect:
    def __init__(self):
        self.groups: list[list[Sample]] = []
        self.reports: list[WorkerStats] = []

    def put(self, dst, body):
        from reflow.types import GroupDone

        if isinstance(body, GroupDone):
            self.groups.append(body.samples)
        elif isinstance(body, WorkerStats):
            self.reports.append(body)


def simulated_worker(control, outbox, weights, window: int, engine=None, carried=None, report_interval_s=1.0,
                     first_tokens_before_sync=False):
    """The live RolloutWorker over a simulated engine, groups of 4 whose answers are 6 to 60 tokens long."""
    import random

    from reflow.config.job_config import RolloutSection, SchedulerSection
    from reflow.modes.rollout_worker import RolloutWorker
    from reflow.rollout.admission import AdmissionGate
    from reflow.rollout.request import Request
    from reflow.rollout.turns import TurnDriver
    from reflow.sim.engine import SimEngine, SimTrajectory
    from reflow.sim.profiles import TINY_CPU
    from reflow.sim.system import SimScorer
    from reflow.sim.workload import Workload

    rng = random.Random(0)

    class Groups:
        draws = 0

        def peek(self):
            return self.draws

        def take(self):
            self.draws += 1
            return self.draws - 1

        def requests(self, draw, version):
            return [Request(f"g{draw}/{k}", [1] * 8, 64, k, meta={"group": f"g{draw}", "draw": draw,
                            "sim": SimTrajectory(rng.randint(6, 60))}) for k in range(GROUP)]

    engine = engine or SimEngine(TINY_CPU, 0, max_steps=4)
    scorer = SimScorer(Workload(name="roles", prompt_tokens=8, median_tokens=30, sigma=0.0, max_tokens=64), seed=0)
    budget = DispatchBudget(DispatchRule(window=window), 0, 1, group_size=GROUP)
    turns, clock = TurnDriver(engine, None, None), lambda: engine.clock
    gate = AdmissionGate(SchedulerSection(), RolloutSection(), engine, GROUP, turns, clock=clock)
    worker = RolloutWorker(engine, turns, Groups(), scorer, weights, control, outbox,
                           budget, gate, 0, [0], carried=carried, clock=clock,
                           report_interval_s=report_interval_s, first_tokens_before_sync=first_tokens_before_sync)
    return worker, engine


class ReloadSameWeights:
    def sync(self, trainer, engine, version):
        engine.load_weights((), version)
        return {}


@pytest.mark.parametrize("first_tokens", [True, False], ids=["one_step_off", "async_reflow"])
def test_a_rollout_worker_over_a_simulated_engine_keeps_its_birth_rule_across_a_sync_and_hands_over(first_tokens):
    """The live RolloutWorker, driven tick by tick: it admits the window's groups; before a weight sync it takes
    the first-token steps in one_step_off (every admitted request's oldest token is from the version it started
    under) and none in async and reflow (a request without a token is held empty and born under the new
    version: later, never staler); it resumes its partial rollouts under the new version, and at a Transition
    holds what is in flight; a new worker resumes the handed-over groups first. Every request started has
    exactly one fate."""
    control, outbox = ScriptedControl(), Collect()
    worker, engine = simulated_worker(control, outbox, ReloadSameWeights(), window=4 * GROUP,
                                      first_tokens_before_sync=first_tokens)
    worker.start()
    for _ in range(3):
        assert worker.tick() is None
    assert len(worker.ledger["started"]) == 4 * GROUP  # the window, whole groups
    # room for two more groups and a sync in one poll: g4 and g5 are admitted on version 0 just before the sync,
    # with no token yet
    control.queue.extend([Progress(steps_done=1, retired=2 * GROUP), SyncWeights(1)])
    assert worker.take_commands() is None
    tokenless = set(worker.ledger["started"][4 * GROUP :])
    assert engine.version == 1 and {rid.split("/")[0] for rid in tokenless} == {"g4", "g5"}
    if first_tokens:
        assert all(req.output_ids for req in engine.active.values())
    else:
        assert all(not engine.active[rid].output_ids for rid in tokenless if rid in engine.active)
    control.queue.append(Progress(steps_done=2, retired=4 * GROUP))  # room for two more groups, on version 1
    for _ in range(1000):
        if len(outbox.groups) >= 3:
            break
        assert worker.tick() is None
    control.queue.append(Transition(2))
    assert isinstance(worker.tick(), Transition)
    handed = worker.ledger["handed_out"]
    sent = [s.uid for samples in outbox.groups for s in samples]
    assert sorted(worker.ledger["started"]) == sorted(sent + handed)  # one fate each
    for samples in outbox.groups:
        draw = samples[0].draw
        started_on = 0 if draw < 6 else 1
        assert all(s.versions == sorted(s.versions) for s in samples)  # what Sample.birth_version relies on
        assert all(s.finish_version >= max(s.versions) for s in samples), draw
        for s in samples:  # born under its admission version, or (no first-token steps) the version after it
            held_empty = not first_tokens and s.uid in tokenless
            assert s.birth_version == (1 if held_empty else started_on), (s.uid, s.versions)
    # the heir resumes the held groups first, their tokens and versions kept, and they count against no budget
    heir_out = Collect()
    heir, _ = simulated_worker(ScriptedControl(), heir_out, ReloadSameWeights(), window=GROUP, engine=engine,
                               carried=worker.carried_out)
    heir.start()
    for _ in range(1000):
        if not heir.turns.num_active:
            break
        assert heir.tick() is None
    finished = {s.uid: s for samples in heir_out.groups for s in samples}
    assert handed and set(handed) <= set(finished)
    assert all((finished[uid].origin == -1) == (uid in handed) for uid in finished)  # its own new group counts




def test_a_rollout_worker_counts_every_engine_step_its_first_token_steps_under_kv_pressure_included():
    """one_step_off's first-token steps before a sync: when the cache holds only some of the admitted requests,
    a queued request starts only once running ones finish, so the sync waits on many engine steps. The worker's
    reports count each of them, as the engine ran them (the engine-steps/s figures and the profiles fitted on a
    run read these counts)."""
    import dataclasses

    from reflow.sim.engine import SimEngine
    from reflow.sim.profiles import TINY_CPU

    tight = dataclasses.replace(TINY_CPU, kv_budget_tokens=6 * TINY_CPU.kv_block_size)  # 6 blocks: 16 requests queue
    control, outbox = ScriptedControl(), Collect()
    engine = SimEngine(tight, 0, max_steps=4)
    worker, _ = simulated_worker(control, outbox, ReloadSameWeights(), window=4 * GROUP, engine=engine,
                                 first_tokens_before_sync=True)
    worker.start()
    assert worker.tick() is None
    queued = len(engine.waiting)
    steps_before_sync = engine.engine_steps
    control.queue.append(SyncWeights(1))
    assert worker.take_commands() is None
    first_token_steps = engine.engine_steps - steps_before_sync
    assert queued and first_token_steps > 1  # the regime: the sync waited on several steps
    assert all(req.output_ids for req in engine.active.values())
    for _ in range(20):
        assert worker.tick() is None
    worker._report()
    assert sum(report.engine_steps for report in outbox.reports) == engine.engine_steps


@pytest.mark.parametrize("interval", [0.5, 2.0])
def test_a_rollout_worker_reports_once_per_interval(interval):
    control, outbox = ScriptedControl(), Collect()
    worker, engine = simulated_worker(control, outbox, ReloadSameWeights(), window=8 * GROUP, report_interval_s=interval)
    worker.start()
    reported_at, ticks = [], 0
    while engine.clock < 20 * interval:
        ticks += 1
        assert ticks < 100_000
        before = len(outbox.reports)
        assert worker.tick() is None
        if len(outbox.reports) > before:
            reported_at.append(engine.clock)
        control.queue.append(Progress(steps_done=0, retired=GROUP * len(outbox.groups)))  # the trainer keeps up
    gaps = [later - earlier for earlier, later in zip(reported_at, reported_at[1:])]
    assert len(reported_at) >= 10 and all(gap > interval for gap in gaps)
    # a report follows the first tick that ends past the interval: at most one macro-step late
    longest_tick = engine.max_steps * engine.profile.step_seconds(8 * GROUP, 8 * GROUP * 72, 8 * GROUP * 8)
    assert all(gap <= interval + longest_tick for gap in gaps)


def test_progress_words_in_one_poll_admit_before_the_sync_behind_them():
    """Two Progress words and a SyncWeights arrive together: the room both freed is filled on the weights of
    now, before the sync (the same as admitting after each word), and nothing is admitted twice."""
    control, outbox = ScriptedControl(), Collect()
    worker, engine = simulated_worker(control, outbox, ReloadSameWeights(), window=2 * GROUP, first_tokens_before_sync=True)
    worker.start()
    assert worker.tick() is None
    assert len(worker.ledger["started"]) == 2 * GROUP
    control.queue.extend([Progress(steps_done=1, retired=GROUP), Progress(steps_done=1, retired=2 * GROUP), SyncWeights(1)])
    assert worker.take_commands() is None
    assert engine.version == 1 and len(worker.ledger["started"]) == 4 * GROUP
    started_before_sync = {rid.split("/")[0] for rid in worker.ledger["started"]}
    assert started_before_sync == {"g0", "g1", "g2", "g3"}
    assert all(req.versions[0] == 0 for req in engine.active.values())  # every one started on version 0


def test_the_leader_restores_its_controller_only_from_a_controller_of_the_same_kind():
    """A checkpoint holds the controller's memory and the rows since its decision; a resumed run whose
    controller is another kind (placement.schedule then the planner, or back) starts its own afresh."""
    from reflow.scheduler import ForcedSchedule, PlacementPlanner, PlannerSettings

    def planner():
        settings = PlannerSettings(world_size=4, shard_degree=1, replica_options=(1, 2, 3), sigma=0.5, batch_size=16)
        return PlacementPlanner(settings)

    saved = Leader(Sink(), GROUP, controller=planner())
    saved.controller.last_change_step, saved.controller.left = 6, 2
    saved.placement_rows = [{"step": 7, "step_time_s": 1.0}]
    state = saved.controller_state()
    assert state["kind"] == "PlacementPlanner"
    resumed = Leader(Sink(), GROUP, controller=planner())
    assert resumed.load_controller_state(state) is None
    assert resumed.controller.state() == saved.controller.state() and resumed.placement_rows == saved.placement_rows
    scheduled = Leader(Sink(), GROUP, controller=ForcedSchedule([(8, 1)]))
    refused = scheduled.load_controller_state(state)
    assert "PlacementPlanner" in refused and "ForcedSchedule" in refused and scheduled.placement_rows == []
    fresh = Leader(Sink(), GROUP, controller=planner())
    assert "ForcedSchedule" in fresh.load_controller_state(scheduled.controller_state())
    assert fresh.controller.state() == planner().state()
    assert Leader(Sink(), GROUP, controller=None).controller_state() is None
