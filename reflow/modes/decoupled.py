"""Decoupled modes: trainer ranks train from their replay-buffer shard while rollout ranks stream samples.

What each mode is (``reflow.modes.settings.resolve_settings``); b = training.prompts_per_step x training.group_size,
k = the weight-sync interval, A = trainer shards:

    one_step_off  sigma 0, delta 1, sync every step, window 2b (steps_ahead 1), staleness counted from the
                  start, and a shard trains only samples exactly one version old: the batch the previous
                  policy began, while the current policy generates the next one (verl's
                  one_step_off_policy recipe). After the first step every trained sample has staleness
                  exactly 1. One difference from verl, which finishes the previous batch on the old weights
                  before it syncs: a sample still generating at the sync continues under the new weights (a
                  partial rollout, as in async). Its staleness, counted from its oldest token, is still 1.
    async         sigma 0, delta = replay.delta, sync every k steps, partial rollouts held across syncs,
                  window (steps_ahead + 1) x b with steps_ahead = delta - k + 1 (the paper's VeRL-async;
                  verl fully_async, AReaL's max_head_offpolicyness and Tinker's sampling_steps_ahead bound the
                  work ahead of the trainer the same way), staleness counted from the version at which a
                  sample's group finished (replay.staleness_from, as verl's fully-async stamps it).
    reflow        async's anchor, a window of steps_ahead x b + ceil(b(1 - sigma)) (in whole groups: a step
                  may retire only that many fresh samples, see below), and the paper's B_max (rollout.b_max,
                  default b): at most B_max samples start between two trainer steps, and credit a step leaves
                  unused expires. Bounded replay lets a shard step on b(1 - sigma) fresh samples topped up to
                  exactly b with replayed ones (loss weight tau).

The replay cycle: the rule, and why nothing is generated in vain
----------------------------------------------------------------
A sample is *started* when admitted to an engine and *retired* when trained for the first time or evicted
unused. (R1) Admission: started - retired <= W over all shards, W = (delta - k + 1) x b + F, F the fewest
fresh samples a step retires (b in async, ceil(b(1 - sigma)) in reflow, whole groups; the window, ``reflow.scheduler.dispatch``: every rollout worker owns a fixed share, or with
scheduler.kv_admission trainer rank 0's ``GroupDispatcher`` deals the room by KV load), and in reflow
at most B_max starts per step period. (R2) Anchor: a group is stamped with the engine version at which it
finished; its staleness is the trained version minus that (``replay.staleness_from = "start"`` keeps the old
anchor, the oldest token, for measurement). Model tokens older than replay.max_head_lag versions (default
2 delta) are masked out of the loss, the rest of the trajectory trains; per-token versions still feed
truncated importance sampling. (R3) Consumption: every shard takes fresh samples earliest deadline first
(oldest finish version, ties by arrival) and a batch holds exactly b/A samples: the trainer waits until every
shard has ceil(b(1 - sigma)/A) fresh ones and fresh plus replayable fill b/A. (R4) Binding: a group is bound
to a shard when it arrives (``reflow.scheduler.routing.ShardRouter``: the fewest unused samples, by the
counts in the latest Progress), not when admitted; while the trainer waits, shards short of samples take the
surplus of others beyond their own need (``plan_moves``, computed alike on every trainer rank from the
readiness all-reduce; the donor sends its latest-deadline samples).

Why nothing is wasted. Take the step at version v and a sample x not yet trained after it, one of at most
W - F_v <= (delta - k + 1) b outstanding once that step's F_v >= F fresh samples retired. x finishes at an
engine version f >= v - (k - 1) (engines sync every k steps; x was still unfinished during step v, or it
would have been eligible for it and is among those outstanding anyway). The samples that can be ahead of x in
deadline order finished no later; those started after step v finish no earlier than x if x had finished, so
the ones ahead are among the <= (delta - k + 1) b outstanding, spread over the shards by R4 (the moves send a
shard's samples due now that its own batch cannot take to shards with room). Every later step takes b/A
from the front of each shard, or every unused sample there: x is trained within delta - k + 1 steps after v,
by version v + delta - k + 1 <= f + delta, within its bound. (With W = (delta - k + 2) b a reflow step that
retired only b(1 - sigma) fresh samples leaves up to (delta - k + 1.5) b outstanding: one step too many.) So
the evictions the ledger counts (``EVICTION_CAUSES``) come only from what the argument leaves out: routing
that is a moment stale, samples restored or handed over outside every window, and a resumed run's first
versions. (Counted from the start, a long answer overtaken by later ones exceeds delta and is evicted: the old
anchor's length bias.)

Control-plane protocol (who waits for whom, and why it cannot deadlock)
-----------------------------------------------------------------------
Planes: the data plane (any rank -> any rank: groups to trainer shards, moves between shards, stats to rank
0, buffer handovers) and the control plane (rank 0 -> any other rank) each run on their own gloo group, one
background thread per process and plane (``reflow.dataplane``); every rank can send and receive, because its
role may change. Rank 0 trains in every placement and leads. Collectives happen only on the main threads:

  trainer ranks   loop: drain the data inbox into the buffer shard (a group already past its bound is retired
                  at once); evict samples past delta; all-reduce(SUM) over the trainer group of "my shard
                  cannot serve a batch yet", the retired counts (per rollout worker) and each shard's
                  eligible, needed and unused counts; rank 0 sends each rollout worker a Progress with its
                  count, the shards' unused counts (and its grants, dealt by the latest load reports, when
                  the dispatcher deals) whenever they changed; if some shard is not ready, every rank makes
                  its part of the moves, sleeps 2 ms (trainer idle) and repeats; else it trains one step.
                  After the step: at a sync point (every k steps) rank 0 sends SyncWeights(v), every trainer
                  rank evicts, then joins the weight sync (trainer-mesh gathers + broadcast to rollout ranks);
                  then the same all-reduce, and rank 0 sends Progress, after SyncWeights.
  rollout ranks   loop (``rollout_worker``): take commands between engine steps, never inside one.
                  SyncWeights(v): step until every admitted request has its first token, hold in-flight
                  requests with their prefix (partial rollout), join the weight sync, resume them.
                  Progress: update the dispatch budget and the router. Then admit whole groups while the
                  budget has room and the engine has capacity; step the engine; every finished group is
                  stamped, scored, routed and put on the data outbox at once. With nothing in flight, block
                  on the control inbox (rollout idle).

Invariants the argument uses. (I1) A sample's birth version (oldest token) is the engine version it was
admitted under: the first-token rule at SyncWeights. (I2) Commands arrive in the order sent, and a rollout
worker admits what a Progress allows before it applies the next command, unless its admission gate (the
scheduler's concurrency cap or KV rule, async and reflow only) holds a group back; the gate only does so
while trajectories are in flight (in the engine, or at a tool, whose calls end within the sandbox's or the
tool's time limit), so the group starts after finitely many engine steps, under weights at least as new:
later and fresher, never staler. So the room allowed after step s is admitted after the SyncWeights of step
s and before the next one: on weights no older than s - (k - 1). (I3) Every rollout worker owns a fixed
share of each limit in whole groups, never smaller than its share of b (``share_groups``), or the dealing
dispatcher hands out all the room the rule allows as soon as it appears (it never withholds any); and a
period's B_max credit expires only when the trainer steps, never while it waits.

No deadlock. (1) The weight sync is the only collective both roles join; both enter it only for a
SyncWeights(v) that trainer rank 0 sent in step order, and a rollout rank reaches it after finishing the
engine steps that give its newest requests their first token. (2) A waiting trainer is eventually served.
While it waits at version v nothing it holds ages, no credit expires, and the engines keep stepping; a group
that arrives now finished at f >= v - (k - 1) >= v - delta and is eligible. Each worker r either has its
window share full (all of it finished, unused, in some shard, once nothing is in flight) or has started its
whole B_max share of this period (which cannot have been consumed yet); either way, by I3, at least its share
of b arrives and stays unused, so >= b eligible samples end up in the shards together. Then ``plan_moves``
gives every short shard what it lacks from the others' surplus (the total covers every shard's need, since
need <= b/A), and every shard is ready. one_step_off (window 2b, k = 1, eligible = born at v - 1): by
induction on v from the version the run started or resumed at (where every sample is born and the floor is
0), exactly b samples are born at v - 1 and b at v, because the room a step's Progress allows is what that
step consumed, all of it admitted at once (validated: rollout.max_num_seqs holds a worker's whole share of
the window, and no admission gate runs in this mode; I1, I2); the moves spread version v - 1's b over the
shards, b/A each. (3) At the end rank 0 sends Stop; rollout ranks drop their in-flight requests; every rank
sends END to every other rank on the data plane and drains until END from every other rank. Every thread
exits; nothing sent is left unreceived (a move in transit arrives before its sender's END).

Rollout tensor parallelism (rollout.tensor_parallel_degree = s_R > 1). A rollout "rank" above is a rollout
*worker*: the first rank of an engine's block of s_R ranks. It alone receives commands, admits, reports and
sends; the block's other ranks replay its engine calls (``reflow.rollout.tensor_parallel``, whose own essay
says why that cannot deadlock) and join the weight sync when it does. Nothing above changes: the collectives
the followers join (vLLM's inside an engine step, the weight sync) are entered by their leader at the same
point, and a follower leaves with the command its leader left with. Placements move whole blocks.

Placement changes (``_transition``; reflow mode). At every sync point trainer rank 0 asks the run's
``PlacementController`` (``ForcedSchedule`` from placement.schedule, or ``PlacementPlanner`` with
scheduler.adaptive_placement, fed the step rows since its last decision) and broadcasts the answer to the
trainer ranks; on a change, the trainer ranks leave their loop and rank 0 sends Transition(n') to every
rollout rank instead of the next command. Placements' trainer ranks are a prefix of the world (0 .. n S - 1). A rollout rank generates
everything it admitted to the end, sends it, sends FLUSH to every trainer rank and joins; a trainer rank
drains until FLUSH from every rollout rank (so each shard holds every group sent to it) and until every
move between shards has arrived; then every
rank, in the same order: the trainer resize (``PolicyTrainer.resize``: staying ranks keep their shards,
joining ranks receive them by bucketized broadcast over the new mesh's dp_replicate groups), a leaving
shard hands its buffer to a staying one, rank 0 broadcasts the trainer's clock (step, version), every rank
all-gathers the rollout ranks' prompt shares and deals them to the new pool without a gap, and the new
placement's weight sync puts the weights into every engine that now generates. No deadlock: rank 0 starts
it in step order, like a weight sync; a rollout rank reaches it after finitely many engine steps; FLUSH
arrives after every group its sender sent (one sender's messages arrive in order), and the rest is
collectives that every rank enters in the same order. Every group sent before the change reaches the shard
it was bound to before that shard moves; a group that finishes after it is bound within the new placement.
The dispatch rule needs nothing carried over: the new budgets start at the step of the change, the retired
counts restart with them, and every sample a shard holds then (its own, or handed over) counts against no
budget (origin -1), as after a resume: extra supply, outside every window.

Checkpoints and resume (``checkpoint_state``, ``_restore``). A checkpoint, taken by the trainer ranks at the end
of a step, holds each shard's buffer and the prompt stream's position: the frontier (one past the furthest draw
any shard received) and the holes below it (draws admitted but not received: in flight at the checkpoint).
Nothing in flight is saved. A resumed run deals the holes to the rollout ranks first, then continues from the
frontier, so every prompt is generated once and no sample is trained fresh twice; the budgets start at the
resumed step, as after a placement change, and restored samples retire against no budget (origin -1), so the
window and B_max arguments above hold from the resumed step as from a new run's first (restored unused
samples are extra supply, outside every window). one_step_off alone restores no unused sample: its induction
starts from the resumed version, so their prompts are holes instead.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from reflow.algorithms.grpo import replay_gradient_share
from reflow.dataplane import ControlChannel, Inbox, Outbox
from reflow.dataplane.transport import DATA
from reflow.modes.base import Components, ModeBase, StepTimer
from reflow.distributed.placement import build_placement
from reflow.modes.commands import Progress, Stop, SyncWeights, Transition
from reflow.modes.prompts import PromptStream, initial_shares, reassign
from reflow.modes.rollout_worker import RolloutWorker
from reflow.rollout.tensor_parallel import EngineMirror, follow
from reflow.modes.rollouts import Sample, to_batch
from reflow.replay import ReplayBuffer, build_filter, build_sampler
from reflow.modes.settings import resolve_settings
from reflow.scheduler import DispatchBudget, ForcedSchedule, PlacementController, PlacementPlanner, PlannerSettings
from reflow.scheduler.dispatch import GroupDispatcher
from reflow.scheduler.routing import Move, ShardCounts, plan_moves
from reflow.trainer.batch import mask_stale_tokens


EVICTION_CAUSES = ("arrived_stale", "aged", "at_sync")
"""Why an unused sample was evicted: it was already past its bound when it arrived; it aged past it in the
buffer while the trainer waited or stepped; or it was found past it at a weight sync."""

_SUMMED_ROLLOUT_STATS = (
    "busy_s", "idle_s", "tool_wait_s", "engine_steps", "step_sequences", "preemptions", "admitted_groups", "gate_refusals"
)
"""Rollout-worker report fields that add up over a window."""


def survival_by_decile(retired: list[tuple[int, bool]]) -> list[float]:
    """``retired``: (response length, trained fresh) per retired sample. Ten equal-count bins by length, shortest
    first: the share of each bin trained fresh (empty when fewer than ten samples retired)."""
    if len(retired) < 10:
        return []
    ordered = sorted(retired)
    bins = [ordered[len(ordered) * k // 10 : len(ordered) * (k + 1) // 10] for k in range(10)]
    return [sum(kept for _, kept in b) / len(b) for b in bins]


class DecoupledMode(ModeBase):
    def __init__(self, parts: Components):
        super().__init__(parts)
        cfg = parts.cfg
        self.name = cfg.training.mode
        self.settings = resolve_settings(cfg)
        self.max_staleness = self.settings.delta
        self.staleness_anchor = self.settings.anchor
        self.evaluates_in_loop = False  # the rollout ranks evaluate at weight syncs (``RolloutWorker._evaluate``)
        self.pending_evals: dict[int, dict] = {}  # rank 0: held-out evaluations by policy version, as reports arrive
        self.rank = parts.rank
        self.stream = PromptStream(parts.train_problems, cfg.job.seed, cfg.task.shuffle)
        # planes: created by every rank at the same point (new_group is collective). Any rank may train or
        # generate over the run, so every rank can send and receive data; commands go from rank 0 (which
        # trains in every placement) to any other rank.
        data_group = dist.new_group(backend="gloo")
        control_group = dist.new_group(backend="gloo")
        others = [r for r in range(parts.world_size) if r != parts.rank]
        everyone_but_leader = [r for r in range(parts.world_size) if r != 0]
        self.control = ControlChannel(control_group, parts.rank, 0, everyone_but_leader)
        self.inbox = Inbox(data_group, others, "data")
        self.outbox = Outbox(data_group, "data")
        self.steps_done = 0
        self.received_in_window = 0  # samples that reached this shard since the previous step
        self.received_tokens_in_window = 0  # and their response tokens (trained or not: evicted ones count too)
        self.received_reward_in_window = 0.0  # and their rewards
        self.evicted_in_window = {cause: 0 for cause in EVICTION_CAUSES}  # unused samples evicted since, by cause
        self.retired_lengths: list[tuple[int, bool]] = []  # (response length, trained fresh) of samples retired since
        self.awaiting_moved = 0  # eligible samples other shards are sending this one (``plan_moves``)
        self.buffer: ReplayBuffer | None = None
        self.rollout_stats: dict[int, dict] = {}  # rank 0: busy/idle seconds per rollout rank since the last step
        # the last window's ratio, KV usage and caps, repeated by a step with no report in it
        self.carried_rollout_state: dict = {"rollout_idle_ratio": 0.0, "kv_usage_mean": 0.0, "concurrency_caps": {}}
        self.ledger: dict = {
            "received": [], "consumed": [], "steps": [], "evicted_unused": [], "evicted_replayable": 0,
            "eviction_causes": {}, "moved_out": [], "moved_in": [],
            "handed_over_unused": [], "handed_in_unused": [], "left_unused": [], "transitions": [],
            "started": [], "sent": [], "dropped_at_stop": [], "restored": [],
        }
        self.shares: list | None = None  # the rollout ranks' prompt shares, made once the resume point is known
        # the prompt stream's position for checkpoints: every draw below the frontier was delivered to a trainer
        # shard, or is a hole (admitted, not delivered: in flight, or dropped at a stop), to generate again
        self.prompt_frontier = 0
        self.prompt_holes: list[int] = []
        self.received_draws: set[int] = set()  # trainer ranks: draws delivered to this shard since the run started
        self.controller = self._placement_controller()
        self.window: list[dict] = []  # metrics rows since the controller's last decision
        self.change_to: int | None = None
        self.flushed: set[int] = set()  # rollout workers whose FLUSH arrived (placement changes)
        self.mirror = self._engine_mirror()
        self._enter(parts.placement)
        if self.is_trainer and not parts.placement.is_rollout(parts.rank):
            parts.engine.sleep()  # frees accelerator memory while this rank trains

    def _engine_mirror(self) -> EngineMirror | None:
        """With rollout tensor parallelism: the broadcast from this rank's engine block leader to the block (every
        block's gloo group is made here by every rank, in the same order: new_group is collective)."""
        placement = self.parts.placement
        if placement.rollout_tp == 1:
            return None
        mine = None
        for first in range(0, placement.world_size, placement.rollout_tp):
            block = list(range(first, first + placement.rollout_tp))
            # a follower waits on its leader's next call for as long as the leader is idle (a long train step,
            # a checkpoint): no collective timeout there; a leader that dies ends the job through torchrun
            group = dist.new_group(ranks=block, backend="gloo", timeout=datetime.timedelta(days=365))
            if self.rank in block:
                mine = EngineMirror(group, first, self.rank)
        return mine

    def _placement_controller(self) -> PlacementController | None:
        parts, cfg = self.parts, self.parts.cfg
        if parts.schedule:
            return ForcedSchedule(parts.schedule)
        if cfg.scheduler.adaptive_placement:
            return PlacementPlanner(
                PlannerSettings(
                    world_size=parts.world_size, shard_degree=parts.placement.shard_degree,
                    replica_options=tuple(sorted(parts.layouts)), sigma=self.settings.sigma,
                    batch_size=cfg.training.prompts_per_step * cfg.training.group_size,
                    cooldown_steps=cfg.scheduler.cooldown_steps, margin=cfg.scheduler.margin,
                    horizon_steps=cfg.scheduler.horizon_steps,
                    transition_cost_s=cfg.scheduler.transition_cost_s,
                )
            )
        return None

    # ================================================================ placement-dependent state

    def _enter(self, placement) -> None:
        """Take up the role and the per-placement state of ``placement`` (at startup and after a transition)."""
        cfg = self.parts.cfg
        self.placement = placement
        self.trainer_ranks = placement.trainer_ranks
        self.rollout_workers = placement.rollout_workers  # one per engine: every rollout rank, or each TP block's first
        self.is_trainer = placement.is_trainer(self.rank)
        # a rank of a tensor-parallel engine that generates but does not lead it replays its leader's calls
        self.is_follower = not self.is_trainer and self.rank not in self.rollout_workers
        self.parts.engine.mirror = self.mirror if self.mirror is not None and self.rank in self.rollout_workers else None
        self.batch_per_shard = cfg.training.prompts_per_step * cfg.training.group_size // len(self.trainer_ranks)
        self.published = None
        self.rollout_stats = {}  # the previous placement's rollout ranks do not count in the new one's ratio
        self.dispatcher = self._new_dispatcher()
        self.dealt_groups: dict[str, int] = {}  # rank 0: groups the dispatcher granted each rollout rank this step
        if self.is_trainer:
            self.shard_index = self.trainer_ranks.index(self.rank)
            self.retired = [0] * len(self.rollout_workers)  # this shard's retirements, per rollout rank
            if self.buffer is None:
                self.buffer = ReplayBuffer(
                    self.settings.sigma,
                    self.settings.delta,
                    build_sampler(cfg.replay.sampler),
                    build_filter(cfg.replay.filter, cfg.replay.filter_reward_low, cfg.replay.filter_reward_high),
                    seed=cfg.job.seed + self.rank,
                    min_staleness=self.settings.min_staleness,
                    anchor=self.settings.anchor,
                )
                self.buffer.start_version = self.version
        if self.shares is not None:
            self.shares = reassign(self.shares, len(self.rollout_workers))

    def _new_dispatcher(self) -> GroupDispatcher | None:
        """Rank 0's dealer of the dispatch room for this placement, starting at the current step (None unless
        ``dealt_dispatch``)."""
        if self.rank != 0 or not self.dealt_dispatch or not self.rollout_workers:
            return None
        cfg = self.parts.cfg
        return GroupDispatcher(
            self.settings.dispatch, len(self.rollout_workers), cfg.training.group_size, cfg.scheduler.rho, start_step=self.step,
        )

    @property
    def dealt_dispatch(self) -> bool:
        """Whether trainer rank 0's ``GroupDispatcher`` deals the dispatch room (scheduler.kv_admission, which
        only async and reflow accept) instead of every rollout rank owning a fixed share."""
        return self.parts.cfg.scheduler.kv_admission

    @property
    def trainer_group(self):
        return self.parts.layouts[self.placement.replicate_degree].group

    @property
    def weight_sync(self):
        return self.parts.weight_syncs[self.placement.replicate_degree]

    # ================================================================ trainer side

    def _receive(self) -> None:
        for message in self.inbox.drain():
            if message.kind != DATA:
                continue
            body = message.body
            if body["type"] in ("group", "handover", "moved"):
                samples = body["samples"]
                if not self.is_trainer:
                    raise RuntimeError(f"rank {self.rank} generates but received samples from rank {message.src}")
                if body["type"] == "group":
                    self._receive_group(samples)
                elif body["type"] == "moved":  # another shard's surplus, sent while this one waits (``plan_moves``)
                    self.buffer.add(samples)
                    self.awaiting_moved -= len(samples)
                    self.ledger["moved_in"].extend(s.uid for s in samples)
                else:  # a leaving shard's buffer: only its unused samples still await their fate
                    for sample in samples:
                        sample.origin = -1  # its budget belonged to the placement that ended
                    self.buffer.add(samples)
                    self.ledger["handed_in_unused"].extend(s.uid for s in samples if s.use_count == 0)
                    self.received_draws.update(body["draws"])  # what it had delivered, for the checkpoints
            elif body["type"] == "stats":  # the sender's engine time, idle time and admission gate since its last report
                window = self.rollout_stats.setdefault(message.src, {key: 0 for key in _SUMMED_ROLLOUT_STATS} | {"kv_usage_sum": 0.0})
                for key in _SUMMED_ROLLOUT_STATS:
                    window[key] += body[key]
                window["kv_usage_sum"] += body["kv_usage_mean"] * body["engine_steps"]
                window["cap"] = body["cap"]
                window.setdefault("cap_changes", []).extend(body["cap_changes"])
                if self.dispatcher is not None and body["load"] is not None and message.src in self.rollout_workers:
                    self.dispatcher.report(self.rollout_workers.index(message.src), body["load"])
            elif body["type"] == "eval":  # a rollout rank's share of the held-out evaluation of one version
                pending = self.pending_evals.get(body["version"])
                if pending is not None:
                    pending["reward_sum"] += body["reward_sum"]
                    pending["count"] += body["count"]
                    pending["reports"] += 1
            elif body["type"] == "flush":
                self.flushed.add(message.src)

    def _receive_group(self, samples: list[Sample]) -> None:
        """A finished group bound to this shard: into the buffer, or retired at once if it arrived stale."""
        self.ledger["received"].extend(s.uid for s in samples)
        self.received_draws.update(s.draw for s in samples)
        self.received_in_window += len(samples)
        self.received_tokens_in_window += sum(len(s.output_ids) for s in samples)
        self.received_reward_in_window += sum(s.reward for s in samples)
        stale = [s for s in samples if self.buffer.is_stale(s, self.version)]
        for sample in stale:
            self._evicted_unused(sample, "arrived_stale")
        self.buffer.add([s for s in samples if not self.buffer.is_stale(s, self.version)])

    def _evict_stale(self, cause: str) -> None:
        """Samples past their staleness bound are never trained (again); an unused one retires as evicted."""
        for sample in self.buffer.evict_stale(self.version):
            if sample.use_count == 0:
                self._evicted_unused(sample, cause)
            else:
                self.ledger["evicted_replayable"] += 1

    def _evicted_unused(self, sample: Sample, cause: str) -> None:
        self._retire(sample, trained=False)
        self.ledger["evicted_unused"].append(sample.uid)
        self.ledger["eviction_causes"][sample.uid] = cause
        self.evicted_in_window[cause] += 1

    def _retire(self, sample: Sample, trained: bool) -> None:
        if 0 <= sample.origin < len(self.retired):
            self.retired[sample.origin] += 1
        self.retired_lengths.append((len(sample.output_ids), trained))

    def _exchange_progress(self, ready: bool, plan: bool = False) -> tuple[bool, list[Move]]:
        """All trainer ranks: is every shard ready, and (``plan``, while the trainer waits) which moves between
        shards ``plan_moves`` makes of the counts? Rank 0 also tells the rollout workers what was retired, and
        how many unused samples each shard holds (for routing).

        One all-reduce(SUM) over the trainer group of [not-ready flags, retired per rollout worker, and per
        shard: eligible samples (received or on their way), the samples its batch needs, urgent samples (at
        their last version), unused samples]: every rank computes the same moves from it."""
        num_rollout, num_shards, shard = len(self.rollout_workers), len(self.trainer_ranks), self.shard_index
        counts = torch.zeros(1 + num_rollout + 4 * num_shards, dtype=torch.long)
        counts[0] = int(not ready)
        counts[1 : 1 + num_rollout] = torch.tensor(self.retired, dtype=torch.long)
        per_shard = [
            self.buffer.num_eligible(self.version) + self.awaiting_moved,
            self.buffer.need(self.batch_per_shard),
            self.buffer.num_urgent(self.version),
            self.buffer.num_unused + self.awaiting_moved,
        ]
        base = 1 + num_rollout
        for k, value in enumerate(per_shard):
            counts[base + k * num_shards + shard] = value
        dist.all_reduce(counts, group=self.trainer_group)
        eligible, needs, urgent, unused = (counts[base + k * num_shards : base + (k + 1) * num_shards].tolist() for k in range(4))
        if self.rank == self.control.leader:
            retired = counts[1 : 1 + num_rollout].tolist()
            progress = (self.steps_done, tuple(retired), tuple(unused))
            if progress != self.published:
                self.published = progress
                granted = None
                if self.dispatcher is not None:
                    before = list(self.dispatcher.granted)
                    granted = self.dispatcher.deal(self.steps_done, retired)
                    for rollout, rank in enumerate(self.rollout_workers):
                        dealt = (granted[rollout] - before[rollout]) // self.parts.cfg.training.group_size
                        self.dealt_groups[str(rank)] = self.dealt_groups.get(str(rank), 0) + dealt
                for rollout, rank in enumerate(self.rollout_workers):
                    grant = granted[rollout] if granted is not None else None
                    self.control.send(rank, Progress(self.steps_done, retired[rollout], grant, tuple(unused)))
        moves = []
        if plan:
            shards = [ShardCounts(e, n, u, self.batch_per_shard) for e, n, u in zip(eligible, needs, urgent)]
            moves = plan_moves(shards)
        return counts[0].item() == 0, moves

    def _apply_moves(self, moves: list[Move]) -> None:
        """This shard's part of ``plan_moves``: a donor sends the samples named, a receiver expects them."""
        for move in moves:
            if move.donor == self.shard_index:
                samples = self.buffer.take_eligible(move.first, move.count, self.version)
                self.outbox.put(self.trainer_ranks[move.receiver], {"type": "moved", "samples": samples})
                self.ledger["moved_out"].extend(s.uid for s in samples)
            elif move.receiver == self.shard_index:
                self.awaiting_moved += move.count

    def _settle_moves(self) -> None:
        """Receive until every sample other shards are moving to this one has arrived."""
        while self.awaiting_moved:
            self._receive()
            time.sleep(0.002)

    def _wait_for_batch(self) -> None:
        """Block (idle) until every trainer shard can serve a batch of exactly b/A and no move between shards is
        pending or due; all trainer ranks leave together."""
        while True:
            self._receive()
            self._evict_stale("aged")
            ready = self.buffer.can_serve(self.batch_per_shard, self.version) and not self.awaiting_moved
            all_ready, moves = self._exchange_progress(ready, plan=True)
            if moves:
                self._apply_moves(moves)
            elif all_ready:
                return
            time.sleep(0.002)

    def _sync_weights(self) -> None:
        parts = self.parts
        if self.rank == self.control.leader:
            self.control.broadcast(SyncWeights(self.version), self.rollout_workers)
            eval_interval = parts.cfg.metrics.eval_interval
            if eval_interval and self.version % eval_interval == 0:  # the rollout ranks evaluate this version
                self.pending_evals[self.version] = {"expected": len(self.rollout_workers), "reward_sum": 0.0, "count": 0, "reports": 0}
        self._evict_stale("at_sync")
        self.weight_sync.sync(parts.trainer, parts.engine, self.version)

    def train_one_step(self, step: int) -> dict:
        parts = self.parts
        timer = StepTimer()
        # 1. wait until every shard can serve a batch of exactly b/A (fresh samples within the staleness bound)
        with timer("wait"):
            self._wait_for_batch()
        # 2. plan: fresh samples earliest deadline first, replayed ones up to sigma, each with its loss weight;
        #    model tokens older than max_head_lag versions leave the loss
        plan = self.buffer.plan_batch(self.batch_per_shard, self.version)
        assert plan is not None and plan.size == self.batch_per_shard, "every shard was ready for a whole batch"
        trained = plan.fresh + plan.replayed
        weights = [1.0] * len(plan.fresh) + [self.settings.tau] * len(plan.replayed)
        batch = to_batch(trained, parts.tokenizer.pad_id, weights)
        model_tokens = batch.num_tokens()
        masked = 0
        if self.settings.max_head_lag is not None:
            masked = mask_stale_tokens(batch, self.version - self.settings.max_head_lag)
        self.ledger["consumed"].extend(
            {
                "uid": s.uid, "step": step, "staleness": self.buffer.staleness(s, self.version),
                "head_lag": s.head_lag(self.version), "response_len": len(s.output_ids),
            }
            for s in plan.fresh
        )
        # 3. train, then hand consumed samples to the replay filter; first uses retire their samples
        train_start = time.time()
        with timer("train"):
            stats = parts.trainer.train_step(batch)
        self.ledger["steps"].append({"step": step, "version": self.version, "train_start": train_start, "train_end": time.time()})
        self.buffer.give_back(plan)
        for sample in plan.fresh:
            self._retire(sample, trained=True)
        self._drawn = max([self._drawn] + [s.draw + 1 for s in plan.fresh])
        trained_version = self.version
        self.version += 1
        self.steps_done = step
        # 4. weight sync at sync points; then tell the rollout ranks (after SyncWeights, in order)
        with timer("sync"):
            if self.version % self.settings.interval == 0:
                self._sync_weights()
        self._exchange_progress(ready=True)  # (only to tell the rollout workers)
        # 5. metrics over the trainer ranks
        row = self.step_metrics(
            plan.fresh, trained, stats, timer, trained_version, trainer_wait_s=timer.get("wait"), rollout_wait_s=0.0
        )
        row.update(self._replay_cycle_metrics(plan, trained_version, model_tokens, masked))
        row.update(
            trainer_wait_s=timer.get("wait"),
            alpha=replay_gradient_share(row["replay_fraction"], self.settings.tau),
            **self._rollout_window(),
            placement=self.placement.name,
        )
        if self.dispatcher is not None:
            row["dispatched_groups"] = self.dealt_groups
            self.dealt_groups = {}
        row.update(self._finished_eval())
        return row

    def _replay_cycle_metrics(self, plan, trained_version: int, model_tokens: int, masked: int) -> dict:
        """What the replay cycle did in this step, over the trainer ranks: fresh and replayed samples, what arrived
        (its count, response length and reward, evicted samples included: ``reward_mean`` is over trained ones),
        unused samples evicted by cause, the head lag of the fresh samples (versions their oldest token is behind
        the trained policy), the model tokens masked for lagging more than max_head_lag, and survival (trained
        fresh / retired) per decile of response length among the samples retired since the previous step."""
        head_lags = [0] * (max(self.max_staleness, self.settings.max_head_lag or 0) + 2)
        for sample in plan.fresh:  # the last bucket holds every lag beyond the others
            head_lags[min(sample.head_lag(trained_version), len(head_lags) - 1)] += 1
        vec = torch.tensor(
            [
                len(plan.fresh), len(plan.replayed), self.received_in_window, self.received_tokens_in_window,
                self.received_reward_in_window, model_tokens, masked,
                *(self.evicted_in_window[cause] for cause in EVICTION_CAUSES), *head_lags,
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(vec, group=self.trainer_group)
        buffered = torch.tensor([len(self.buffer)], dtype=torch.float64)
        dist.all_reduce(buffered, op=dist.ReduceOp.MAX, group=self.trainer_group)
        retired: list = [None] * dist.get_world_size(self.trainer_group)
        dist.all_gather_object(retired, self.retired_lengths, group=self.trainer_group)
        self.received_in_window = self.received_tokens_in_window = 0
        self.received_reward_in_window = 0.0
        self.evicted_in_window = {cause: 0 for cause in EVICTION_CAUSES}
        self.retired_lengths = []
        fresh, replayed, received = int(vec[0]), int(vec[1]), int(vec[2])
        evicted = {cause: int(vec[7 + k]) for k, cause in enumerate(EVICTION_CAUSES)}
        return {
            "fresh_samples": fresh,
            "replayed_samples": replayed,
            "replay_fraction": replayed / max(fresh + replayed, 1),
            "received_samples": received,
            # what the engines generated, before staleness eviction (response_len_mean is over trained samples)
            "received_response_len_mean": vec[3].item() / received if received else 0.0,
            "received_reward_mean": vec[4].item() / received if received else 0.0,
            "masked_token_frac": vec[6].item() / vec[5].item() if vec[5].item() else 0.0,
            "evicted_unused": sum(evicted.values()),
            **{f"evicted_{cause}": count for cause, count in evicted.items()},
            "head_lag_counts": [int(x) for x in vec[7 + len(EVICTION_CAUSES) :].tolist()],
            "survival_by_length_decile": survival_by_decile([pair for part in retired for pair in part]),
            "buffer_size_max": int(buffered.item()),
        }

    def _finished_eval(self) -> dict:
        """Rank 0: the newest evaluation every rollout rank has reported since the previous step, as
        ``eval_reward`` with the ``eval_policy_version`` it measured (older finished ones are superseded)."""
        done = [v for v, p in self.pending_evals.items() if p["reports"] >= p["expected"]]
        if not done:
            return {}
        latest = self.pending_evals[max(done)]
        for version in [v for v in self.pending_evals if v <= max(done)]:
            del self.pending_evals[version]
        return {"eval_reward": latest["reward_sum"] / max(latest["count"], 1), "eval_policy_version": max(done)}

    def _rollout_window(self) -> dict:
        """The rollout ranks' reports since the previous step, as metrics (rank 0 receives the reports; zeros
        elsewhere); then a new window starts. The idle ratio is the idle share of their time. A step shorter
        than the report period (about 1 s) counts nothing, keeps the reports for the next window, and repeats
        the previous window's ratio, KV usage and caps."""
        reports = self.rollout_stats
        idle = sum(s["idle_s"] for s in reports.values())
        busy = sum(s["busy_s"] + s["tool_wait_s"] for s in reports.values())
        if idle + busy > 0:
            self.rollout_stats = {}
        else:
            reports = {}
        steps = sum(s["engine_steps"] for s in reports.values())
        if reports:  # a window with time in it: its ratio, KV usage and caps become the ones carried
            self.carried_rollout_state = {
                "rollout_idle_ratio": idle / (idle + busy),
                "kv_usage_mean": sum(s["kv_usage_sum"] for s in reports.values()) / steps if steps else 0.0,
                "concurrency_caps": {str(rank): s["cap"] for rank, s in sorted(reports.items())},
            }
        total = lambda key: sum(s[key] for s in reports.values())  # noqa: E731
        return {
            **self.carried_rollout_state,
            "rollout_busy_s": total("busy_s"),
            "rollout_idle_s": total("idle_s"),
            "rollout_tool_wait_s": total("tool_wait_s"),
            "rollout_engine_steps": steps,
            "rollout_step_sequences": total("step_sequences"),
            "preemptions": total("preemptions"),
            "admitted_groups": total("admitted_groups"),
            "gate_refusals": total("gate_refusals"),
            "cap_changes": {str(rank): s["cap_changes"] for rank, s in sorted(reports.items()) if s.get("cap_changes")},
        }

    # ================================================================ rollout side

    def _rollout_worker(self) -> RolloutWorker:
        parts = self.parts
        index = self.rollout_workers.index(self.rank)
        budget = DispatchBudget(
            self.settings.dispatch, index, len(self.rollout_workers), parts.cfg.training.group_size,
            start_step=self.step, dealt=self.dealt_dispatch,
        )
        return RolloutWorker(
            parts, self.weight_sync, self.control, self.outbox, budget, self.stream, self.shares[index], index,
            self.trainer_ranks, len(self.rollout_workers), evaluate_first=self._evaluates_start,
        )

    @property
    def _evaluates_start(self) -> bool:
        """A new run (not a resumed one) evaluates its starting policy, version 0, before generating."""
        return bool(self.parts.cfg.metrics.eval_interval) and self.version == 0 and self.step == 0

    # ================================================================ both

    def run(self) -> list[dict]:
        self.resume()
        self._restore()
        self.steps_done = self.step
        self.dispatcher = self._new_dispatcher()  # its budgets start at the step the run resumed at
        self.shares = initial_shares(len(self.rollout_workers), self._drawn, self.prompt_holes)
        if self.is_trainer:
            self.buffer.start_version = self.version  # the engines start (or resume) on this version
        if self.rank == self.control.leader and self._evaluates_start:
            self.pending_evals[0] = {"expected": len(self.rollout_workers), "reward_sum": 0.0, "count": 0, "reports": 0}
        if self.resumed_replicas not in (None, self.placement.replicate_degree):
            # resumed from a checkpoint saved on another placement: take it up again before the first step
            # (nothing is in flight yet; every rank knows the saved placement)
            if self.resumed_replicas in self.parts.layouts:
                self._transition(self.resumed_replicas)
            else:
                self.parts.logger.info(
                    f"the checkpoint was saved with {self.resumed_replicas} trainer replicas, not feasible on this "
                    f"world; continuing on {self.placement.name}"
                )
        history = []
        while True:
            if self.is_trainer:
                self.change_to = None
                history += self.train_loop()
                if self.rank == self.control.leader:
                    self.control.broadcast(Transition(self.change_to) if self.change_to else Stop(), self.rollout_workers)
                target = self.change_to
            else:
                if self.is_follower:
                    command = follow(self.parts.engine, self.mirror, self.weight_sync)
                else:
                    worker = self._rollout_worker()
                    command = worker.run()
                    self._merge_rollout_ledger(worker.ledger)
                target = command.replicas if isinstance(command, Transition) else None
            if target is None:
                break
            self._transition(target)
        self._shut_down()
        return history

    def pause_requested(self, row: dict) -> bool:
        """At a sync point, trainer rank 0 asks the placement controller; every trainer rank learns the answer."""
        if self.controller is None:
            return False
        self.window.append(row)
        if self.version % self.settings.interval:
            return False
        target = torch.zeros(1, dtype=torch.long)
        if self.rank == 0:
            decision = self.controller.decide(self.step, self.placement.replicate_degree, self.window)
            target[0] = decision.target or 0
            self.window = []
            if decision.target is not None or not isinstance(self.controller, ForcedSchedule):  # a schedule's no-ops are noise
                self.parts.logger.log(self.step, decision.as_row())
                self.parts.logger.info(f"placement decision after step {self.step}: {decision.reason}")
        dist.broadcast(target, src=0, group=self.trainer_group)
        self.change_to = int(target.item()) or None
        return self.change_to is not None

    def _merge_rollout_ledger(self, worker_ledger: dict) -> None:
        for key in ("started", "sent", "dropped_at_stop"):
            self.ledger[key].extend(worker_ledger[key])

    def _transition(self, replicas: int) -> None:
        """Every rank, after the step a placement change follows (a sync point; rollout ranks have finished and
        sent everything in flight):

          1. rollout workers send FLUSH to every trainer rank; trainer ranks drain until they have FLUSH from every
             rollout worker, so each shard holds every sample addressed to it
          2. the trainer resizes (staying ranks keep their shards, joining ranks receive theirs)
          3. leaving trainer ranks hand their buffer to the staying shard of index (their index mod A'); nothing
             else can reach them: every group sent before the change arrived before FLUSH
          4. every rank learns how far each rollout rank drew the prompt stream and takes up the new placement's
             state (roles, prompt shares dealt without a gap, buffers, budgets)
          5. the new placement's weight sync puts the current weights into every new rollout rank's engine
        """
        parts = self.parts
        t0 = time.perf_counter()
        old = self.placement
        new = build_placement(old.world_size, replicas, old.shard_degree, old.world_size - replicas * old.shard_degree,
                              rollout_tp=old.rollout_tp)
        # 1. flush the data plane into the shards
        if self.rank in self.rollout_workers:
            for rank in self.trainer_ranks:
                self.outbox.put(rank, {"type": "flush"})
        elif self.is_trainer:  # (a tensor-parallel engine's followers sent nothing: they skip this)
            while not set(self.rollout_workers) <= self.flushed:
                self._receive()
                time.sleep(0.002)
            self.flushed.clear()
            self._settle_moves()
        # 2. the trainer's shards
        resized = parts.trainer.resize(replicas, bucket_bytes=int(parts.cfg.weight_sync.bucket_size_mb * 2**20))
        # 3. a leaving shard's samples go to a staying one (use counts and versions kept)
        if self.is_trainer and not new.is_trainer(self.rank):
            samples = self.buffer.drain()
            heir = new.trainer_ranks[self.shard_index % new.num_trainer_ranks]
            self.outbox.put(heir, {"type": "handover", "samples": samples, "draws": self.received_draws})
            self.received_draws = set()  # the heir answers for them now
            self.ledger["handed_over_unused"].extend(s.uid for s in samples if s.use_count == 0)
            self.buffer = None
        # 4. the trainer's clock (a rank that generated did not count steps), the prompt shares as the rollout
        #    ranks left them, then the new placement's roles and state
        clock = torch.tensor([self.step, self.version, self.steps_done, self._drawn], dtype=torch.long)
        dist.broadcast(clock, src=0)  # rank 0 trains in every placement
        self.step, self.version, self.steps_done, self._drawn = (int(x) for x in clock.tolist())
        mine = self.shares[self.rollout_workers.index(self.rank)] if self.rank in self.rollout_workers else None
        gathered = [None] * old.world_size
        dist.all_gather_object(gathered, mine)
        self.shares = [gathered[rank] for rank in self.rollout_workers]
        self._enter(new)
        if self.is_trainer:  # the budgets start afresh: no sample counts against one of the old placement's
            for sample in self.buffer.unused + self.buffer.replayable:
                sample.origin = -1
        # 5. weights into every engine that generates now (an engine that was asleep wakes in load_weights)
        self.weight_sync.sync(parts.trainer if self.is_trainer else None, parts.engine, self.version)
        if self.is_trainer and not old.is_trainer(self.rank) and not self.placement.is_rollout(self.rank):
            parts.engine.sleep()
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        moved = torch.tensor([resized.bytes_moved], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.all_reduce(moved)
        event = {
            "transition": f"{old.name} -> {new.name}", "direction": resized.direction if self.rank == 0 else "",
            "placement": new.name, "transition_s": seconds.item(), "bytes_moved": int(moved.item()), "after_step": self.step,
        }
        self.ledger["transitions"].append(event)
        self.window.append(event)  # the controller learns what the change cost
        if self.rank == 0:
            parts.logger.log(self.step, {k: v for k, v in event.items() if k != "after_step"})
            parts.logger.info(f"placement {old.name} -> {new.name} after step {self.step} in {seconds.item():.2f}s")

    def _shut_down(self) -> None:
        """END to every other rank on the data plane; drain until END from every other rank (rank 0 logs an
        evaluation of the final policy that finished meanwhile); close the planes."""
        self.outbox.close([r for r in range(self.parts.world_size) if r != self.rank])
        while not self.inbox.done:
            self._receive()
            time.sleep(0.005)
        self._receive()
        self.inbox.join()
        final_eval = self._finished_eval() if self.rank == self.control.leader else {}
        if final_eval:  # the last weight sync's evaluation arrived after the last step's row: a row of its own
            self.parts.logger.log(self.step, final_eval)
        if self.buffer is not None:
            self.ledger["left_unused"].extend(s.uid for s in self.buffer.unused)
            self.ledger["left_replayable"] = len(self.buffer.replayable)
        self.control.close()
        self._write_ledger()

    def checkpoint_state(self) -> tuple[dict, dict[str, object]]:
        """Beside the trainer's state: each shard's replay buffer (samples with their use counts, versions and
        advantages, and the sampler's random state), and on rank 0 the prompt stream's position: the frontier
        (one past the furthest draw delivered to any shard) and the holes below it (draws admitted but not
        delivered: generated again after a resume, so no prompt is lost or trained twice). Samples in flight
        are not saved; their prompts are holes. One all-gather of the draws delivered over the trainer group."""
        self._settle_moves()  # a sample moving between shards is in one of them when saved
        extra, files = super().checkpoint_state()
        # one_step_off trains exactly the batch of the previous version, counted from the version the run
        # (re)started at (its no-deadlock induction): it saves no unused sample, their prompts become holes
        # (a group's samples stay together there: whole groups per shard and per batch)
        regenerate = self.settings.min_staleness > 0
        unused = [] if regenerate else self.buffer.unused
        regenerated = {sample.draw for sample in self.buffer.unused} if regenerate else set()
        gathered: list = [None] * dist.get_world_size(self.trainer_group)
        dist.all_gather_object(gathered, (self.received_draws, regenerated), group=self.trainer_group)
        received = set().union(*(draws for draws, _ in gathered))
        # (a group's samples may sit in two shards after a move: its draw is a hole if any of them is unused)
        delivered = received - set().union(*(draws for _, draws in gathered))
        frontier = max([self.prompt_frontier - 1, *received]) + 1
        candidates = set(self.prompt_holes) | set(range(self.prompt_frontier, frontier))
        holes = sorted(candidates - delivered)
        extra["prompts_drawn"] = frontier
        files[f"replay-shard{self.shard_index}"] = {
            "unused": unused, "replayable": self.buffer.replayable, "rng": self.buffer.rng.getstate(),
        }
        if self.rank == 0:
            files["prompt-stream"] = {"frontier": frontier, "holes": holes}
        return extra, files

    def _restore(self) -> None:
        """After ``resume``: the prompt stream's position, and each trainer shard's share of the saved buffers
        (saved shard k goes to shard k mod A: the same shard when the placement is the saved one). Restored
        samples belong to no rollout rank's budget (origin -1): the budgets restart at the resumed step."""
        checkpoints = self.parts.checkpoints
        stream = checkpoints.read_files("prompt-stream").get("prompt-stream")
        if stream is None:  # a checkpoint without it (sync mode's): the furthest prompt drawn
            return
        self.prompt_frontier, self.prompt_holes = stream["frontier"], list(stream["holes"])
        self._drawn = self.prompt_frontier
        restored = 0
        if self.is_trainer:
            saved = checkpoints.read_files("replay-shard")
            for name, state in saved.items():
                if int(name.removeprefix("replay-shard")) % len(self.trainer_ranks) != self.shard_index:
                    continue
                samples = state["unused"] + state["replayable"]
                for sample in samples:
                    sample.origin = -1
                self.buffer.add(samples)
                restored += len(samples)
                if int(name.removeprefix("replay-shard")) == self.shard_index:
                    self.buffer.rng.setstate(state["rng"])
                self.ledger["restored"].extend(
                    {"uid": x.uid, "use_count": x.use_count, "versions": x.versions, "advantage": x.advantage} for x in samples
                )
        count = torch.tensor([restored], dtype=torch.long)
        dist.all_reduce(count)
        self.parts.logger.info(
            f"restored {int(count.item())} replay-buffer samples; {len(self.prompt_holes)} prompts admitted but not "
            f"delivered at the checkpoint are generated again; the stream continues at draw {self.prompt_frontier}"
        )

    def _write_ledger(self) -> None:
        path = os.path.join(self.parts.cfg.job.dump_folder, "ledger", f"rank{self.rank}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"rank": self.rank, "trainer": self.is_trainer, **self.ledger}, f)
