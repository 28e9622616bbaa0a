"""2 ranks, FSDP2 over both: the log-probs and one train step with the output projection run whole
(``training.logprob_chunk_tokens = 0``) and in chunks of 5 tokens (not dividing a micro-batch's tokens).
Writes, per rank, the largest differences of the log-probs, the loss, the gradient norm and the updated
parameter shards to argv[1] (a JSON file per rank: argv[1].rank<N>)."""

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
gen = torch.Generator().manual_seed(rank)
rows = [(torch.randint(3, 30, (4,), generator=gen).tolist(), torch.randint(3, 30, (3 + k,), generator=gen).tolist())
        for k in range(8)]
batch = pack([p for p, _ in rows], [o for _, o in rows], [[-3.0] * len(o) for _, o in rows], [[0] * len(o) for _, o in rows],
             [1.0, -1.0] * 4, [1.0] * 8, [0.0] * 8, 0)
results = {}
for chunk in (0, 5):
    cfg = JobConfig()
    cfg.training.micro_batch_size = 3  # several micro-batches, of different widths
    cfg.training.num_minibatches = 2  # a separate "old" log-prob forward, then two updates
    cfg.training.logprob_chunk_tokens = chunk
    trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
    initial = {name: param.to_local().detach().clone() for name, param in trainer.model.named_parameters()}
    logprobs = trainer.compute_logprobs(batch)
    stats = trainer.train_step(batch)
    shards = {name: param.to_local().detach().clone() for name, param in trainer.model.named_parameters()}
    results[chunk] = (logprobs, stats, shards)
(lp_whole, stats_whole, shards_whole), (lp_chunked, stats_chunked, shards_chunked) = results[0], results[5]
mask = batch.loss_mask.bool()
report = {
    "logprob_max_diff": (lp_whole - lp_chunked)[mask].abs().max().item(),
    "logprob_scale": lp_whole[mask].abs().max().item(),
    "loss": [stats_whole.loss, stats_chunked.loss],
    "grad_norm": [stats_whole.grad_norm, stats_chunked.grad_norm],
    "param_max_diff": max((shards_whole[n] - shards_chunked[n]).abs().max().item() for n in shards_whole),
    "param_max_change": max((shards_whole[n] - initial[n]).abs().max().item() for n in shards_whole),
}
with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
    json.dump(report, f)
exit_ranks()
