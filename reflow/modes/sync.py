"""``sync``: on-policy and colocated. The baseline every other mode is compared with.

Every rank is both a trainer shard and a rollout engine. Each step:

  1. dispatch   all ranks draw the same P prompts; rank r takes prompts r, r+W, ...
                and asks its engine for G samples of each (a group stays on one rank)
  2. rollout    generate to completion with the current weights (version v), with a multi-turn task's
                environment answering between model turns; on CUDA the trainer's
                state waits in pinned host memory meanwhile (training.offload_while_generating)
  3. score      the run's reward (reflow.rewards), the advantage estimator's group stage
  4. filter     with reward.dynamic_sampling (DAPO eq. 11): every group whose rewards are all equal is
                dropped, and the ranks add up the groups kept; while fewer than P are kept, all ranks draw
                the missing number of prompts, split as in 1, and repeat 1-3 on them (at most
                MAX_EXTRA_ROUNDS extra rounds, DAPO's max_num_gen_batches; after them the step trains on
                what it kept); then exactly P groups stay, the first in draw order. The engine sleeps
                (its memory freed for training, on CUDA) only after the last round
  5. train      the estimator's batch stage over the kept samples, then one trainer step (FSDP2 across
                all ranks) on the local ones
  6. sync       gather on the trainer mesh -> vLLM reload_weights (version v+1)

Generation and training alternate, so each side idles while the other works:
exactly the inefficiency the ``reflow`` mode removes.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from reflow.algorithms.settings import advantage_estimator
from reflow.algorithms.shaping import MAX_EXTRA_BATCHES, has_signal
from reflow.dataplane.collectives import reduce_stats
from reflow.modes.base import Components, ModeBase, StepTimer
from reflow.rewards import outcome_reward
from reflow.rollout.groups import make_group_requests
from reflow.rollout.scoring import assign_advantages, score
from reflow.trainer.batch import to_batch, zero_batch
from reflow.types import Sample, WorkerStats

MAX_EXTRA_ROUNDS = MAX_EXTRA_BATCHES
"""Dynamic sampling's rounds of generation a step may add to fill its P groups (DAPO's max_num_gen_batches)."""


class SyncMode(ModeBase):
    name = "sync"

    def __init__(self, parts: Components):
        super().__init__(parts)
        if not parts.placement.colocated:
            raise ValueError(
                "training.mode = 'sync' runs colocated: set placement.num_rollout_ranks = 0 "
                f"(got {parts.placement.num_rollout_ranks})"
            )

    def train_one_step(self, step: int) -> dict:
        parts = self.parts
        training = parts.cfg.training
        timer = StepTimer(parts.timeline)
        engine_stats = WorkerStats()
        # the trainer's state waits in host memory while the engine generates (on CUDA only)
        with timer("gen"):
            park_start = time.perf_counter()
            parts.trainer.park("optimizer", "parameters")
            engine_stats.busy_s += time.perf_counter() - park_start
        # 1.-3. dispatch, rollout with the current weights, score: the same global prompt list on every rank
        drawn = self.next_prompts(training.prompts_per_step)
        samples = self._generate_round(drawn, timer, engine_stats)
        # 4. filter (dynamic sampling): keep P groups with signal over the ranks, generating more rounds for them
        filtering = {"dynamic_sampling_filtered_frac": 0.0, "dynamic_sampling_rounds": 0}
        if parts.cfg.reward.dynamic_sampling:  # (it adds received_reward_mean: reward_mean is over kept groups)
            samples, filtering = self._keep_groups_with_signal(drawn, samples, timer, engine_stats)
        with timer("gen"):
            # after the last round the engine frees its memory for training (on CUDA); a sync follows this step's
            # update: the engine's weights are overwritten then, so they are dropped now rather than copied to
            # host memory and back (not a LoRA run's: its sync adds an adapter over the base the engine keeps)
            sleep_start = time.perf_counter()
            parts.engine.sleep(discard_weights=(self.version + 1) % parts.cfg.weight_sync.interval == 0
                               and not parts.engine.pins_versions)
            engine_stats.busy_s += time.perf_counter() - sleep_start - parts.turns.take_tool_wait()
            # the step's generation ends with its slowest rank's: a faster rank's wait for it is generation time,
            # not a slow first collective of the train step (rows and the simulator's fit read them apart)
            dist.barrier()
        # 5. train: the estimator's batch stage over the kept samples (every rank joins its all-reduce), then one
        #    trainer step (the parked state comes back first); a rank whose groups were all dropped trains one
        #    zero-weight row, which keeps its collectives in step with the other ranks'
        self.first_use_advantages(samples)
        if samples:
            batch = to_batch(samples, parts.tokenizer.pad_id, mask_truncated=parts.cfg.loss.mask_truncated)
        else:
            batch = zero_batch(None)
        with timer("train"):
            stats = parts.trainer.train_step(batch)
        trained_version = self.version
        self.version += 1
        # 6. sync the new weights into every engine (load_weights wakes it first; the optimizer state, which the
        #    sync does not read, leaves the device before the engine takes it)
        with timer("sync"):
            if self.version % parts.cfg.weight_sync.interval == 0:
                parts.trainer.park("optimizer")
                parts.weight_sync.sync(parts.trainer, parts.engine, self.version)
        # with the engines' window, summed over the ranks (the simulator fits its colocated engine cost from it)
        row = self.step_metrics(
            samples, samples, stats, timer, trained_version,
            trainer_wait_s=timer.get("gen"), engine_window=engine_stats,
            loss_tokens=batch.loss_weighted_tokens(),  # (a rank with no group trains a zero-weight row: 0)
        )
        row.update(filtering)
        # what the engines generated: the trained samples themselves unless dynamic sampling dropped groups
        row.setdefault("received_reward_mean", row["reward_mean"])
        return row

    def _generate_round(self, drawn: list, timer: StepTimer, engine_stats: WorkerStats) -> list[Sample]:
        """Steps 1-3 for ``drawn``, the same prompt list on every rank: this rank's share (prompts r, r+W, ...),
        G samples of each generated to completion with the current weights (a multi-turn task's environment
        answering between model turns), then scored, with the estimator's group stage."""
        parts = self.parts
        training = parts.cfg.training
        requests = [
            r
            for draw, p in drawn[parts.rank :: parts.world_size]
            for r in make_group_requests(
                p, draw, parts.task, parts.tokenizer, training.group_size, parts.cfg.rollout.max_new_tokens,
                parts.cfg.job.seed, self.version,
            )
        ]
        with timer("gen"):
            gen_start = time.perf_counter()
            finished = parts.turns.generate(requests, engine_stats)
            engine_stats.busy_s += time.perf_counter() - gen_start
        with timer("score"):
            samples = score(finished, parts.task, parts.tokenizer, parts.rewards)
            assign_advantages(samples, advantage_estimator(parts.cfg))
        return samples

    def _keep_groups_with_signal(
        self, drawn: list, samples: list[Sample], timer: StepTimer, engine_stats: WorkerStats
    ) -> tuple[list[Sample], dict]:
        """Step 4, DAPO's dynamic sampling over the ranks. ``drawn``: the step's first prompt list (the same on
        every rank); ``samples``: this rank's groups of it. After each round the ranks sum one flag per drawn
        prompt (1: its group has signal; a prompt's group lives on one rank), so every rank knows which draws
        were kept; while fewer than P are, the missing number is drawn and generated (``_generate_round``), at
        most MAX_EXTRA_ROUNDS times. Then the first P kept draws in draw order stay, the same on every rank.
        Returns this rank's kept samples and the row's dynamic_sampling_filtered_frac (groups dropped for no
        signal / groups generated, over the ranks; groups are whole, so it is the samples' share too),
        dynamic_sampling_rounds (the extra rounds generated) and received_reward_mean (over every sample
        generated, the dropped included, as the decoupled modes count what arrived: the kept groups leave out
        the prompts solved by all or none, so their mean is not the policy's)."""
        parts = self.parts
        wanted = parts.cfg.training.prompts_per_step
        draws = [draw for draw, _ in drawn]
        kept: dict[int, list[Sample]] = {}  # draw -> this rank's group with signal
        kept_draws: list[int] = []  # every rank's, in draw order
        generated = rounds = 0
        reward_total = reward_count = 0.0
        while True:
            local: dict[int, list[Sample]] = {}
            for sample in samples:
                local.setdefault(sample.draw, []).append(sample)
            flags = [int(draw in local and has_signal([outcome_reward(s) for s in local[draw]])) for draw in draws]
            with timer("gen"):  # the ranks agree on what was kept (a faster rank waits here: generation time)
                totals = reduce_stats(
                    {"signal": flags, "reward": sum(s.reward for s in samples), "samples": len(samples)},
                    self.trainer_group,
                )
            summed = totals["signal"]
            reward_total += totals["reward"]
            reward_count += totals["samples"]
            generated += len(draws)
            for draw, signal in zip(draws, summed):
                if signal:
                    kept_draws.append(draw)
                    if draw in local:
                        kept[draw] = local[draw]
            missing = wanted - len(kept_draws)
            if missing <= 0 or rounds == MAX_EXTRA_ROUNDS:
                break
            rounds += 1
            more = self.next_prompts(missing)
            draws = [draw for draw, _ in more]
            samples = self._generate_round(more, timer, engine_stats)
        if missing > 0:
            parts.logger.info(
                f"dynamic sampling: {len(kept_draws)} of {wanted} groups with signal after {rounds} extra rounds; "
                "the step trains on those"
            )
        # exactly P: the first by draw order (a round draws only what is missing, so this drops nothing unless a
        # round is made to draw more)
        chosen = set(sorted(kept_draws)[:wanted])
        out = [s for draw in sorted(kept) if draw in chosen for s in kept[draw]]
        filtered = generated - len(kept_draws)
        return out, {
            "dynamic_sampling_filtered_frac": filtered / generated, "dynamic_sampling_rounds": rounds,
            "received_reward_mean": reward_total / max(reward_count, 1.0),
        }
