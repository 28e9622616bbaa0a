"""3 ranks: ranks 0-1 train (FSDP2 over a 2-rank sub-mesh), rank 2 only generates.

1. every rank builds its vLLM engine; ranks 0-1 build the trainer
2. the trainer takes one optimizer step with a large learning rate
3. weight sync: gather on the trainer mesh, bucketed flat broadcast to rank 2, reload_weights
4. rank 2 samples completions; it ships tokens and vLLM log-probs to the trainer ranks
5. trainer ranks recompute the log-probs: they must agree with vLLM's (and differ from the old weights)

Writes a JSON report to argv[1] from rank 0.
"""

import json
import sys

import torch
import torch.distributed as dist

from reflow.config.job_config import JobConfig
from reflow.distributed import build_placement, build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.qwen3 import build_model_config
from reflow.model.recipe import load_recipe, resolve_path
from reflow.rollout.engine import Request, RolloutEngine
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.trainer.batch import to_batch
from reflow.trainer.hf_io import build_adapter
from reflow.trainer.policy import PolicyTrainer
from reflow.types import Sample
from reflow.weight_sync import WeightSync, build_sync_plan

out_path = sys.argv[1]
rank, world, device = init_distributed()
assert world == 3
cfg = JobConfig()
cfg.training.lr = 5e-3
cfg.training.micro_batch_size = 8
cfg.weight_sync.bucket_size_mb = 0.5  # several buckets for a 3 MB model
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
placement = build_placement(world, 1, -1, 1)
layouts = build_trainer_layouts(world, placement.shard_degree, [placement.replicate_degree])
engine = RolloutEngine(cfg.rollout, recipe, hf_dir, seed=rank)
trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device) if placement.is_trainer(rank) else None
model_cfg = build_model_config(recipe)
plan = build_sync_plan(model_cfg, build_adapter(model_cfg, hf_dir), cfg.weight_sync.bucket_size_mb, torch.float32)
sync = WeightSync(placement, plan, rank, device)
tok = PromptTokenizer(hf_dir)


def rollout_on_rank2(tag):
    """Rank 2 samples; everyone receives the samples (object broadcast from rank 2)."""
    payload = [None]
    if rank == 2:
        reqs = [Request(f"{tag}{i}", tok.encode(p), 24, seed=i)
                for i, p in enumerate(["3+4+5=", "9+9+1+2=", "1+2=", "7+0+6+6+2="] * 4)]
        done = engine.generate(reqs)
        payload = [[(r.prompt_ids, r.output_ids, r.logprobs, r.versions) for r in done]]
    dist.broadcast_object_list(payload, src=2)
    return [Sample(f"s{i}", i // 4, f"g{i % 4}", p, o, lp, v, reward=0.0) for i, (p, o, lp, v) in enumerate(payload[0])]


before = rollout_on_rank2("a")
# one training step on those samples, with made-up advantages so the weights move
for i, s in enumerate(before):
    s.advantage = 1.0 if i % 2 else -1.0
batch = to_batch(before, tok.pad_id)
if trainer is not None:
    mine = batch.slice(rank * 8, rank * 8 + 8)
    trainer.train_step(mine)
stats = sync.sync(trainer, engine, version=1)
after = rollout_on_rank2("b")
report = {"buckets": len(plan.buckets), "sync_s": stats["weight_sync_s"]}
if trainer is not None:
    b = to_batch(after, tok.pad_id)
    new_lp = trainer.compute_logprobs(b)
    diff = ((new_lp - b.behavior_logprobs) * b.loss_mask).abs()
    report["max_abs_diff"] = diff.max().item()
    report["mean_abs_diff"] = (diff.sum() / b.loss_mask.sum()).item()
    report["versions"] = sorted({v for s in after for v in s.versions})
    # the same tokens scored by vLLM before the update: the sync really changed the policy
    old_b = to_batch(before, tok.pad_id)
    old_new = trainer.compute_logprobs(old_b)
    report["change_vs_old_weights"] = (((old_new - old_b.behavior_logprobs) * old_b.loss_mask).abs().max()).item()
    report["num_tokens"] = int(b.loss_mask.sum().item())
    # the sync's one-collective gather of a bucket equals DTensor.full_tensor, tensor by tensor, bitwise,
    # including rows that do not divide by the shard degree (5 rows over 2 ranks) and a rank with no rows
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from reflow.distributed.buckets import gather_full

    tensors = [t.detach() for t in trainer.model.state_dict().values()]
    tensors += [
        distribute_tensor(torch.arange(15.0).view(5, 3), trainer.mesh, [Replicate(), Shard(0)]),
        distribute_tensor(torch.arange(3.0).view(1, 3), trainer.mesh, [Replicate(), Shard(0)]),
    ]
    gathered = gather_full(tensors)
    report["gather_full_equal"] = all(torch.equal(g, t.full_tensor()) for g, t in zip(gathered, tensors))
    report["gather_full_tensors"] = len(tensors)
if rank == 0:
    with open(out_path, "w") as f:
        json.dump(report, f)
exit_ranks()
