"""1 rank: how many policy forwards a train step runs. One update per batch (ppo_epochs = num_minibatches = 1)
needs no separate "old" log-prob forward; two minibatches do. And the token slots its passes compute
(``StepStats.pass_tokens``) on rows of unequal length. Writes a JSON report to argv[1]."""

import json
import sys

import torch

from reflow.config.job_config import JobConfig
from reflow.distributed import build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.recipe import load_recipe, resolve_path
from reflow.trainer.batch import pack
from reflow.trainer.policy import PolicyTrainer

rank, world, device = init_distributed()
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
layouts = build_trainer_layouts(world, world, [1])
gen = torch.Generator().manual_seed(0)
rows = [(torch.randint(3, 30, (4,), generator=gen).tolist(), torch.randint(3, 30, (6,), generator=gen).tolist())
        for _ in range(8)]
batch = pack([p for p, _ in rows], [o for _, o in rows], [[-1.0] * 6] * 8, [[0] * 6] * 8, [1.0, -1.0] * 4, [1.0] * 8,
             [0.0] * 8, 0)
report = {}
for minibatches in (1, 2):
    cfg = JobConfig()
    cfg.training.num_minibatches = minibatches
    cfg.training.micro_batch_size = 64  # one micro-batch per minibatch
    trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
    calls = []
    trainer.model.register_forward_hook(lambda module, args, out: calls.append(1))
    stats = trainer.train_step(batch)
    report[str(minibatches)] = {
        "forwards": len(calls), "clip_fraction": stats.clip_fraction, "loss": stats.loss, "pass_tokens": stats.pass_tokens,
    }
# rows of 4 prompt tokens and 2, 9, 3, 6 response tokens, two rows a pass: the passes hold the two shortest (6 and
# 7 tokens) and the two longest (10 and 13), each padded to its longest row
outputs = [[5] * n for n in (2, 9, 3, 6)]
uneven = pack([[7, 8, 9, 10]] * 4, outputs, [[-1.0] * len(o) for o in outputs], [[0] * len(o) for o in outputs],
              [1.0, -1.0, 1.0, -1.0], [1.0] * 4, [0.0] * 4, 0)
cfg = JobConfig()
cfg.training.micro_batch_size = 2
trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
report["uneven_pass_tokens"] = trainer.train_step(uneven).pass_tokens
report["uneven_row"] = trainer.train_step(uneven).as_row()["train_pass_tokens"]
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
exit_ranks()
