"""One trainer shard's side of the replay cycle: receive, evict, retire, report readiness, move, plan.

A ``TrainerShard`` owns one replay-buffer shard and the counts the protocol (``docs/decoupled_protocol.md``)
needs from it. It never talks to another rank: the ``TrainerRole`` (``reflow.modes.trainer_role``) runs the
one collective, the readiness exchange, through a ``ReadinessExchange`` (``GlooReadinessExchange`` live;
``InProcessExchange`` where one process holds every shard, as the simulator does) and carries its moves. So
the live run, the simulator and the unit tests drive the same object.

  accept_group     a finished group bound to this shard (R4): into the buffer, or retired at once as
                   evicted if it is already past its bound (cause "arrived_stale"), or, with dynamic
                   sampling, if its rewards are all equal (cause "no_signal": it is *filtered*, and its
                   samples refund the per-step credit, ``reflow.scheduler.dispatch``)
  evict_stale      samples past delta are never trained again; an unused one retires as evicted
  readiness        what the exchange sums: can this shard serve exactly b/A now, its retirements and
                   filtered samples per rollout worker (the R1 and B_max counts), and its eligible, needed,
                   urgent and unused samples (for ``plan_moves`` and the router)
  donate / expect  this shard's part of the moves ``TrainerView.moves`` computed alike on every rank
  plan / retire    a batch of exactly b/A (R3: fresh earliest deadline first), then the first uses retire
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reflow.algorithms.shaping import MAX_EXTRA_BATCHES, has_signal
from reflow.config.mode_settings import ModeSettings
from reflow.modes.ledger import EVICTION_CAUSES, FILTERED
from reflow.replay import ReplayBuffer
from reflow.replay.buffer import BatchPlan
from reflow.replay.policies import ReplayFilter, Sampler
from reflow.rewards import outcome_reward
from reflow.scheduler.routing import Move
from reflow.types import Sample, SampleStage, ShardReadiness


@dataclass
class ShardWindow:
    """What reached and left a shard since the previous step (for the step's metrics)."""

    received: int = 0
    received_tokens: int = 0
    """Response tokens of what arrived (trained or not: evicted samples count too)."""
    received_reward: float = 0.0
    evicted: dict[str, int] = field(default_factory=lambda: {cause: 0 for cause in EVICTION_CAUSES})
    retired_lengths: list[tuple[int, bool]] = field(default_factory=list)
    """(response length, trained fresh) of every sample retired, but those filtered for carrying no signal."""


class TrainerShard:
    def __init__(
        self, buffer: ReplayBuffer, index: int, num_rollout: int, batch_per_shard: int, ledger: dict,
        dynamic_sampling: bool = False,
    ):
        self.buffer = buffer
        self.index = index
        self.batch_per_shard = batch_per_shard
        self.ledger = ledger
        self.dynamic_sampling = dynamic_sampling
        """DAPO's dynamic sampling (reward.dynamic_sampling): a group whose rewards are all equal never enters
        the buffer."""
        self.retired = [0] * num_rollout
        self.filtered = [0] * num_rollout
        """Of ``retired``, the samples filtered for carrying no signal, per rollout worker."""
        self.filtered_in_a_row = 0
        """Samples filtered since the latest group with signal arrived (dynamic sampling's patience)."""
        self.window = ShardWindow()
        self.awaiting_moved = 0
        """Eligible samples other shards are sending this one (``plan_moves``)."""
        self.received_draws: set[int] = set()
        """Draws delivered to this shard over the run (for the checkpoints' prompt holes)."""
        self.revision = 0
        """Counts the changes to what ``readiness`` reads (a reader may keep a report until it moves)."""

    # ---- arrivals ------------------------------------------------------------------

    def accept_group(self, samples: list[Sample], version: int) -> None:
        self.revision += 1
        self.ledger["received"].extend(s.uid for s in samples)
        self.received_draws.update(s.draw for s in samples)
        self.window.received += len(samples)
        self.window.received_tokens += sum(len(s.output_ids) for s in samples)
        self.window.received_reward += sum(s.reward for s in samples)
        if self.dynamic_sampling and not has_signal([outcome_reward(s) for s in samples]):
            # DAPO eq. 11: zero advantage under every group baseline, no gradient. Retired at once, so the
            # window reopens; counted as filtered, so its per-step credit comes back (no deadlock under B_max)
            for sample in samples:
                sample.enter(SampleStage.EVICTED)
                self._evicted_unused(sample, FILTERED)
                if 0 <= sample.origin < len(self.filtered):
                    self.filtered[sample.origin] += 1
            self.filtered_in_a_row += len(samples)
            if self.filtered_in_a_row >= MAX_EXTRA_BATCHES * max(self.batch_per_shard, 1):
                raise RuntimeError(
                    f"reward.dynamic_sampling: trainer shard {self.index} received {self.filtered_in_a_row} samples "
                    f"in a row ({MAX_EXTRA_BATCHES} batches' worth) whose groups' rewards were all equal: the policy "
                    "solves every prompt or none, and no batch can fill. Set reward.dynamic_sampling = false, or give "
                    "the task prompts of mixed difficulty"
                )
            return
        self.filtered_in_a_row = 0
        for sample in samples:  # R2: staleness from the anchor version (the finish, in async and reflow)
            if self.buffer.is_stale(sample, version):
                sample.enter(SampleStage.EVICTED)
                self._evicted_unused(sample, "arrived_stale")
            else:
                sample.enter(SampleStage.RECEIVED)
                self.buffer.add([sample])

    def accept_moved(self, samples: list[Sample]) -> None:
        self.revision += 1
        for sample in samples:
            sample.enter(SampleStage.RECEIVED)
        self.buffer.add(samples)
        self.awaiting_moved -= len(samples)
        self.ledger["moved_in"].extend(s.uid for s in samples)

    def accept_handover(self, samples: list[Sample], draws: frozenset[int]) -> None:
        """A leaving shard's buffer (placement change): its budgets belonged to the placement that ended."""
        self.revision += 1
        for sample in samples:
            sample.origin = -1
            sample.enter(sample.buffered_stage)
        self.buffer.add(samples)
        self.ledger["handed_in_unused"].extend(s.uid for s in samples if s.use_count == 0)
        self.received_draws.update(draws)

    def hand_over(self) -> tuple[list[Sample], frozenset[int]]:
        """This shard leaves: its whole buffer and its draws go to an heir, which answers for them now."""
        self.revision += 1
        samples = self.buffer.drain()
        for sample in samples:
            sample.enter(SampleStage.HANDED_OVER)
        draws = frozenset(self.received_draws)
        self.received_draws = set()
        self.ledger["handed_over_unused"].extend(s.uid for s in samples if s.use_count == 0)
        return samples, draws

    def rejoin(self, index: int, batch_per_shard: int, num_rollout: int) -> None:
        """A shard kept across a placement change: its index and share of the batch in the new trainer group, and
        budgets that start afresh."""
        self.index, self.batch_per_shard = index, batch_per_shard
        self.restart_budgets(num_rollout)

    def restart_budgets(self, num_rollout: int) -> None:
        """A new placement's budgets start afresh: no sample held now counts against one (origin -1)."""
        self.revision += 1
        for sample in self.buffer.unused + self.buffer.replayable:
            sample.origin = -1
        self.retired = [0] * num_rollout
        self.filtered = [0] * num_rollout

    # ---- retirement ----------------------------------------------------------------

    def evict_stale(self, version: int, cause: str) -> None:
        gone = self.buffer.evict_stale(version)
        if gone:
            self.revision += 1
        for sample in gone:
            if sample.use_count == 0:
                sample.enter(SampleStage.EVICTED)
                self._evicted_unused(sample, cause)
            else:
                sample.enter(SampleStage.DROPPED)
                self.ledger["evicted_replayable"] += 1

    def _evicted_unused(self, sample: Sample, cause: str) -> None:
        # a filtered sample retires (the window) but is no staleness loss: survival by length leaves it out
        self._retire(sample, trained=False, survival=cause != FILTERED)
        self.ledger["evicted_unused"].append(sample.uid)
        self.ledger["eviction_causes"][sample.uid] = cause
        self.window.evicted[cause] += 1

    def _retire(self, sample: Sample, trained: bool, survival: bool = True) -> None:
        if 0 <= sample.origin < len(self.retired):
            self.retired[sample.origin] += 1
        if survival:
            self.window.retired_lengths.append((len(sample.output_ids), trained))

    # ---- readiness and moves --------------------------------------------------------

    def readiness(self, version: int) -> ShardReadiness:
        ready = self.buffer.can_serve(self.batch_per_shard, version) and not self.awaiting_moved
        return ShardReadiness(
            ready=ready, retired=tuple(self.retired), filtered=tuple(self.filtered),
            eligible=self.buffer.num_eligible(version) + self.awaiting_moved,
            need=self.buffer.need(self.batch_per_shard),
            urgent=self.buffer.num_urgent(version),
            unused=self.buffer.num_unused + self.awaiting_moved,
        )

    def donate(self, moves: list[Move], version: int) -> list[tuple[int, list[Sample]]]:
        """This shard's part of the moves: (receiving shard, samples) for each it donates to; it expects the
        ones it receives."""
        out = []
        self.revision += 1
        for move in moves:
            if move.donor == self.index:
                samples = self.buffer.take_eligible(move.first, move.count, version)
                for sample in samples:
                    sample.enter(SampleStage.MOVED)
                self.ledger["moved_out"].extend(s.uid for s in samples)
                out.append((move.receiver, samples))
            elif move.receiver == self.index:
                self.awaiting_moved += move.count
        return out

    # ---- the step -------------------------------------------------------------------

    def plan(self, version: int) -> BatchPlan:
        """R3: exactly b/A, fresh samples earliest deadline first, replayed ones up to sigma (every shard was ready)."""
        self.revision += 1
        plan = self.buffer.plan_batch(self.batch_per_shard, version)
        if plan is None or plan.size != self.batch_per_shard:
            raise RuntimeError(f"trainer shard {self.index} was ready for a batch of {self.batch_per_shard} but cannot serve it")
        return plan

    def retire_trained(self, plan: BatchPlan) -> None:
        """After the step: the replay filter takes the consumed samples, first uses retire theirs."""
        self.revision += 1
        self.buffer.give_back(plan)
        kept = {id(s) for s in self.buffer.replayable}
        for sample in plan.fresh + plan.replayed:
            sample.enter(SampleStage.TRAINED if id(sample) in kept else SampleStage.DROPPED)
        for sample in plan.fresh:
            self._retire(sample, trained=True)

    def restore(self, samples: list[Sample], rng_state) -> None:
        """A resumed run's share of the saved buffers (``reflow.modes.resume.restored_share``), with the sampler's
        random state where the checkpoint kept one."""
        self.revision += 1
        for sample in samples:  # (a sample saved by an older run reads FINISHED: its stage starts here)
            sample.stage = sample.buffered_stage
        self.buffer.add(samples)
        if rng_state is not None:
            self.buffer.rng.setstate(rng_state)

    def take_window(self) -> ShardWindow:
        window, self.window = self.window, ShardWindow()
        return window

    def leave_at_end(self) -> None:
        self.ledger["left_unused"].extend(s.uid for s in self.buffer.unused)
        self.ledger["left_replayable"] = len(self.buffer.replayable)


def new_shard(
    settings: ModeSettings, index: int, num_rollout: int, batch_per_shard: int, ledger: dict, *, sampler: Sampler,
    replay_filter: ReplayFilter, seed: int, start_version: int, dynamic_sampling: bool = False,
) -> TrainerShard:
    """A shard with an empty buffer under the mode's replay settings (sigma, delta, the staleness floor and
    anchor), its versions counted from ``start_version`` (the version the engines start or resume on). The live
    run and the simulator both make their shards here."""
    buffer = ReplayBuffer(
        settings.sigma, settings.delta, sampler, replay_filter, seed=seed, min_staleness=settings.min_staleness,
        anchor=settings.anchor,
    )
    buffer.start_version = start_version
    return TrainerShard(buffer, index, num_rollout, batch_per_shard, ledger, dynamic_sampling=dynamic_sampling)
