"""``sync``: on-policy, colocated GRPO. The baseline every other mode is compared with.

Every rank is both a trainer shard and a rollout engine. Each step:

  1. dispatch   all ranks draw the same P prompts; rank r takes prompts r, r+W, ...
                and asks its engine for G samples of each (a group stays on one rank)
  2. rollout    generate to completion with the current weights (version v), with a multi-turn task's
                environment answering between model turns; on CUDA the trainer's
                state waits in pinned host memory meanwhile (training.offload_while_generating)
  3. score      the run's reward (reflow.rewards), the advantage estimator's group and batch stages
  4. train      one trainer step (FSDP2 across all ranks) on the local samples
  5. sync       gather on the trainer mesh -> vLLM reload_weights (version v+1)

Generation and training alternate, so each side idles while the other works:
exactly the inefficiency the ``reflow`` mode removes.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from reflow.algorithms.settings import advantage_estimator
from reflow.modes.base import Components, ModeBase, StepTimer
from reflow.rollout.groups import make_group_requests
from reflow.rollout.scoring import assign_advantages, score
from reflow.trainer.batch import to_batch
from reflow.types import WorkerStats


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
        timer = StepTimer()
        # 1. dispatch: the same global prompt list on every rank, a shard each
        drawn = self.next_prompts(training.prompts_per_step)
        requests = [
            r
            for draw, p in drawn[parts.rank :: parts.world_size]
            for r in make_group_requests(
                p, draw, parts.task, parts.tokenizer, training.group_size, parts.cfg.rollout.max_new_tokens,
                parts.cfg.job.seed, self.version,
            )
        ]
        # 2. rollout with the current weights; the trainer's state waits in host memory meanwhile and the engine
        #    frees its memory for training afterwards (both on CUDA only)
        engine_stats = WorkerStats()
        gen_start = time.perf_counter()
        with timer("gen"):
            parts.trainer.park("optimizer", "parameters")
            finished = parts.turns.generate(requests, engine_stats)
            # a sync follows this step's update: the engine's weights are overwritten then, so they are dropped
            # now rather than copied to host memory and back
            parts.engine.sleep(discard_weights=(self.version + 1) % parts.cfg.weight_sync.interval == 0)
            engine_stats.busy_s = time.perf_counter() - gen_start - parts.turns.take_tool_wait()
            # the step's generation ends with its slowest rank's: a faster rank's wait for it is generation time,
            # not a slow first collective of the train step (rows and the simulator's fit read them apart)
            dist.barrier()
        # 3. score
        samples = score(finished, parts.task, parts.tokenizer, parts.rewards)
        assign_advantages(samples, advantage_estimator(parts.cfg))
        self.first_use_advantages(samples)
        batch = to_batch(samples, parts.tokenizer.pad_id, mask_truncated=parts.cfg.loss.mask_truncated)
        # 4. train (the parked state comes back first)
        with timer("train"):
            stats = parts.trainer.train_step(batch)
        trained_version = self.version
        self.version += 1
        # 5. sync the new weights into every engine (load_weights wakes it first; the optimizer state, which the
        #    sync does not read, leaves the device before the engine takes it)
        with timer("sync"):
            if self.version % parts.cfg.weight_sync.interval == 0:
                parts.trainer.park("optimizer")
                parts.weight_sync.sync(parts.trainer, parts.engine, self.version)
        # with the engines' window, summed over the ranks (the simulator fits its colocated engine cost from it)
        return self.step_metrics(
            samples, samples, stats, timer, trained_version,
            trainer_wait_s=timer.get("gen"), engine_window=engine_stats,
        )
