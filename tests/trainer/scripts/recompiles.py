"""1 rank: how many graphs dynamo compiles over steps whose micro-batch widths and row counts all differ.

The compiled blocks train (SDPA: flex attention has no backward on CPU); torchtitan's compiled flex attention
scores log-probs (forward only). Dynamo's guards decide what recompiles, whatever the backend, so both compile
with the 'eager' backend here (seconds instead of Inductor's minutes on CPU). Writes JSON to argv[1]: the
unique graphs after each step, and whether a recompile-limit hit would fail."""

import json
import sys

import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

import reflow.trainer.parallelize as parallelize
from reflow.config.job_config import JobConfig
from reflow.distributed import build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.recipe import load_recipe, resolve_path
from reflow.trainer.batch import pack
from reflow.trainer.policy import PolicyTrainer


def compile_blocks_with_eager_backend(model):
    parallelize.refuse_eager_fallback()
    for block in model.layers.values():
        block.compile(fullgraph=True, backend="eager")


def batch(rows: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 30, (4,), generator=g).tolist() for _ in range(rows)]
    # one row at the full width, the others shorter: micro-batches of the length-sorted rows differ in width
    outs = [torch.randint(3, 30, (max(1, width - 3 * i),), generator=g).tolist() for i in range(rows)]
    return pack(prompts, outs, [[-1.0] * len(o) for o in outs], [[0] * len(o) for o in outs],
                [(-1.0) ** i for i in range(rows)], [1.0] * rows, [0.0] * rows, 0)


rank, world, device = init_distributed()
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
layouts = build_trainer_layouts(world, 1, [1])
parallelize.apply_block_compile = compile_blocks_with_eager_backend
import reflow.trainer.policy as policy  # noqa: E402

policy.apply_block_compile = compile_blocks_with_eager_backend
# widths and row counts of a long-tail run: 3 rows per micro-batch, so the last one of 7 or 5 rows is smaller
SHAPES = [(7, 10), (7, 23), (5, 37), (7, 50), (4, 71), (7, 90), (6, 13), (7, 120), (5, 64), (7, 101)]
report = {}


def graphs_after_each_step(run_one) -> list[int]:
    """``run_one(batch)`` over every shape of ``SHAPES``: the graphs dynamo has compiled after each."""
    graphs = []
    for step, (rows, width) in enumerate(SHAPES):
        run_one(batch(rows, width, step))
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


cfg = JobConfig()
cfg.training.compile = True
cfg.training.micro_batch_size = 3
trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
report["train_graphs"] = graphs_after_each_step(trainer.train_step)

counters.clear()
import torchtitan.models.common.attention as attention  # noqa: E402

attention.FlexAttention._compiled_flex_attn = torch.compile(flex_attention, backend="eager")
cfg = JobConfig()
cfg.model.attention = "flex"
cfg.training.micro_batch_size = 3
scorer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
report["flex_logprob_graphs"] = graphs_after_each_step(scorer.compute_logprobs)
report["fail_on_recompile_limit_hit"] = bool(torch._dynamo.config.fail_on_recompile_limit_hit)
report["recompile_limit"] = int(torch._dynamo.config.recompile_limit)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
exit_ranks()
