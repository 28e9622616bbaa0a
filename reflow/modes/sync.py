"""``sync``: on-policy, colocated GRPO. The baseline every other mode is compared with.

Every rank is both a trainer shard and a rollout engine. Each step:

  1. dispatch   all ranks draw the same P prompts; rank r takes prompts r, r+W, ...
                and asks its engine for G samples of each (a group stays on one rank)
  2. rollout    generate to completion with the current weights (version v)
  3. score      task reward, group-normalized advantages
  4. train      one trainer step (FSDP2 across all ranks) on the local samples
  5. sync       gather on the trainer mesh -> vLLM reload_weights (version v+1)

Generation and training alternate, so each side idles while the other works:
exactly the inefficiency the ``reflow`` mode removes.
"""

from __future__ import annotations



from reflow.modes.base import Components, ModeBase, StepTimer
from reflow.modes.rollouts import assign_advantages, make_group_requests, score, to_batch


class SyncMode(ModeBase):
    name = "sync"

    def __init__(self, c: Components):
        super().__init__(c)
        if not c.placement.colocated:
            raise ValueError(
                "training.mode = 'sync' runs colocated: set placement.num_rollout_ranks = 0 "
                f"(got {c.placement.num_rollout_ranks})"
            )

    def train_one_step(self, step: int) -> dict:
        c = self.c
        t = c.cfg.training
        timer = StepTimer()
        # 1. dispatch: the same global prompt list on every rank, a shard each
        drawn = self.next_prompts(t.prompts_per_step)
        requests = [
            r
            for draw, p in drawn[c.rank :: c.world_size]
            for r in make_group_requests(
                p, draw, c.task, c.tokenizer, t.group_size, c.cfg.rollout.max_new_tokens, c.cfg.job.seed, self.version
            )
        ]
        # 2. rollout with the current weights; the engine then frees its memory for training (GPU)
        with timer("gen"):
            finished = c.engine.generate(requests)
            c.engine.sleep()
        # 3. score
        samples = score(finished, c.task, c.tokenizer)
        assign_advantages(samples, t.normalize_adv_std, t.advantage_eps)
        batch = to_batch(samples, c.tokenizer.pad_id)
        # 4. train
        with timer("train"):
            stats = c.trainer.train_step(batch)
        self.version += 1
        # 5. sync the new weights into every engine (load_weights wakes it first)
        with timer("sync"):
            if self.version % c.cfg.weight_sync.interval == 0:
                c.weight_sync.sync(c.trainer, c.engine, self.version)
        return self.step_metrics(
            samples, samples, stats, timer, trainer_wait_s=timer.get("gen"), rollout_wait_s=timer.get("train") + timer.get("sync")
        )
