"""2 ranks: the same training with and without a per-block option (argv[2]: 'activation_checkpointing', or
'compile'), through a resize (2 replicas -> 1): the shards after it (bitwise equal, and the largest
difference), the same state-dict names. argv[3] (optional, default 1): how many data seeds the first step
is also compared on (the relative difference of its loss and gradient norm, per seed). Writes a JSON report
to argv[1]. argv[4] (optional, default 0): a LoRA rank, for the same run with adapters on every projection."""

import json
import sys

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from reflow.config.job_config import JobConfig
from reflow.distributed import build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.recipe import load_recipe, resolve_path
from reflow.trainer.batch import pack
from reflow.trainer.elastic import shard_tensors
from reflow.trainer.policy import PolicyTrainer

rank, world, device = init_distributed()
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
layouts = build_trainer_layouts(world, 1, [2, 1])
gen = torch.Generator().manual_seed(0)


def virtual(k: int, seed: int = 0):
    g = torch.Generator().manual_seed(k + 1000 * seed)
    rows = [(torch.randint(3, 30, (4,), generator=g).tolist(),
             torch.randint(3, 30, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()) for _ in range(4)]
    return pack([p for p, _ in rows], [o for _, o in rows], [[-1.0] * len(o) for _, o in rows], [[0] * len(o) for _, o in rows],
                [1.0, -1.0, 0.5, -0.5], [1.0] * 4, [0.0] * 4, 0)


OPTION = sys.argv[2]
NUM_SEEDS = int(sys.argv[3]) if len(sys.argv) > 3 else 1
LORA_RANK = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # LoRA adapters on every projection (0: none)
SETTINGS = {"activation_checkpointing": ("none", "full"), "compile": (False, True)}[OPTION]


def build(value) -> PolicyTrainer:
    cfg = JobConfig()
    cfg.training.lr = 2e-3
    cfg.training.num_minibatches = 2
    cfg.kl.coef = 0.05
    cfg.lora.rank = LORA_RANK
    setattr(cfg.training, OPTION, value)
    return PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 2, device)


def run(value):
    trainer = build(value)
    stats = trainer.train_step([virtual(rank)])
    first_loss[str(value)] = (stats.loss, stats.grad_norm)
    keys = sorted(trainer.model.state_dict())
    wrapped[str(value)] = sum(
        isinstance(m, CheckpointWrapper) or getattr(m, "_compiled_call_impl", None) is not None for m in trainer.model.modules()
    )
    trainer.resize(1, bucket_bytes=1 << 20)
    if trainer.active:
        trainer.train_step([virtual(0), virtual(1)])
        return [t.clone() for t in shard_tensors(trainer.model, trainer.optimizer, trainer.ref_model)], keys
    return None, keys


def first_steps(value) -> list[tuple[float, float]]:
    """The first step's (loss, grad norm) from the same initial weights on each data seed."""
    out = []
    for seed in range(NUM_SEEDS):
        stats = build(value).train_step([virtual(rank, seed)])
        out.append((stats.loss, stats.grad_norm))
    return out


wrapped: dict[str, int] = {}
first_loss: dict[str, tuple[float, float]] = {}  # the first step's (loss, grad norm)
plain, plain_keys = run(SETTINGS[0])
optioned, option_keys = run(SETTINGS[1])
report = {
    "same_keys": plain_keys == option_keys, "wrapper_in_keys": any("checkpoint" in k or "_orig_mod" in k for k in option_keys),
    "wrapped": wrapped, "first_step": first_loss,
}
if NUM_SEEDS > 1:
    pairs = zip(first_steps(SETTINGS[0]), first_steps(SETTINGS[1]))
    report["first_step_relative_diffs"] = [
        (abs(b[0] - a[0]) / max(abs(a[0]), 1e-3), abs(b[1] - a[1]) / max(abs(a[1]), 1e-12)) for a, b in pairs
    ]
if rank == 0:
    report["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(plain, optioned)) and len(plain) == len(optioned)
    report["max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(plain, optioned))
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
exit_ranks()
