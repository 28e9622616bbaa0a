"""2 ranks, one FSDP2 trainer sharded over both: for every loss aggregation, one optimizer update on a batch
served whole by rank 0 in one micro-batch (rank 1 only pads the collectives) and on the same batch split
over the two ranks in micro-batches of one or two rows must give the same loss and gradient.
Writes a JSON report to argv[1].

The batch has rows of different lengths, a row whose tokens are all masked, replay weights 1 and tau = 0.5,
and behaviour log-probs away from the trainer's (the off-policy weight is not 1), so every aggregation's
scale and denominator matter: dividing a micro-batch's sum by its own denominator, or a rank's by its own,
would move the gradient norm by far more than float rounding."""

import json
import sys

import torch

from reflow.algorithms.aggregation import AGGREGATIONS
from reflow.config.job_config import JobConfig
from reflow.distributed import build_trainer_layouts, exit_ranks, init_distributed
from reflow.model.recipe import load_recipe, resolve_path
from reflow.trainer.batch import index, pack, zero_batch
from reflow.trainer.policy import PolicyTrainer

rank, world, device = init_distributed()
assert world == 2
recipe = load_recipe("tiny")
hf_dir = resolve_path(recipe.hf_checkpoint)
layouts = build_trainer_layouts(world, 2, [1])
ROWS = 8


def global_batch():
    gen = torch.Generator().manual_seed(7)
    prompts, outputs, lps, versions, advs = [], [], [], [], []
    for row in range(ROWS):
        n = 2 + 3 * (row % 4)  # 2, 5, 8, 11 tokens
        prompts.append(torch.randint(3, 30, (3,), generator=gen).tolist())
        outputs.append(torch.randint(3, 30, (n,), generator=gen).tolist())
        lps.append((-torch.rand(n, generator=gen) * 4).tolist())
        versions.append([0] * n)
        advs.append(float(torch.randn(1, generator=gen)))
    weights = [1.0, 0.5] * (ROWS // 2)
    batch = pack(prompts, outputs, lps, versions, advs, weights, [0.0] * ROWS, 0)
    batch.loss_mask[3] = 0.0  # a row with nothing left to train (a stale head, an overlong filter)
    batch.loss_mask[5, :4] = 0.0  # part of a row masked
    return batch


EXTRAS = {
    # the other trainer paths, which must compose across micro-batches and ranks as well: the KL penalty as a
    # reward (the reference model on), masked IS (old log-probs scored before the update), an entropy bonus,
    # a KL in the loss with k2 and sequence-level truncated IS, and a warmup (the first update at lr / 2)
    "kl_reward+token_mask+entropy": {"kl.coef": 0.05, "kl.placement": "reward", "off_policy.correction": "token_mask",
                                     "off_policy.band_low": 0.2, "off_policy.band_high": 5.0, "loss.entropy_coef": 0.01},
    "kl_k2_loss+sequence_tis+warmup": {"kl.coef": 0.05, "kl.estimator": "k2", "off_policy.correction": "sequence_tis",
                                       "training.warmup_steps": 2},
}


def run(aggregation: str, policy: str, split: bool, extras: dict | None = None, *, uneven: bool = False,
        micro_batch_size: int | None = None, minibatches: int = 1, micro_batch_tokens: int = 0) -> dict:
    cfg = JobConfig()
    cfg.training.lr = 1e-3
    cfg.training.max_norm = 0.0  # the update sees the raw gradient
    cfg.loss.aggregation, cfg.loss.policy = aggregation, policy
    cfg.off_policy.cap = 10.0
    cfg.training.micro_batch_size = micro_batch_size or (2 if split or uneven else ROWS)
    cfg.training.num_minibatches = minibatches
    cfg.training.micro_batch_tokens = micro_batch_tokens
    for dotted, value in (extras or {}).items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    trainer = PolicyTrainer.from_config(cfg, recipe, hf_dir, layouts, 1, device)
    batch = global_batch()
    if uneven:  # rows 0-5 on rank 0 and 6-7 on rank 1 (sync mode's dynamic sampling keeps groups unevenly)
        mine = index(batch, torch.arange(0, 6) if rank == 0 else torch.arange(6, ROWS))
    elif split:  # rows 0, 2, 4, 6 on rank 0 and 1, 3, 5, 7 on rank 1: two micro-batches each
        mine = index(batch, torch.arange(rank, ROWS, 2))
    else:
        mine = batch if rank == 0 else zero_batch(batch)
    grads = []
    step = trainer.optimizer.step

    def record_then_step(*args, **kwargs):  # the accumulated gradient, as the optimizer gets it
        grads.append(torch.cat([p.grad.full_tensor().flatten() for p in trainer.model.parameters()]))
        return step(*args, **kwargs)

    trainer.optimizer.step = record_then_step
    stats = trainer.train_step(mine)
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "grad": grads[0], "grads": grads, "lr": stats.lr,
            "dropped": stats.off_policy_dropped_frac, "entropy": stats.entropy, "kl": stats.kl_ref,
            "passes": len(trainer._micro_batches(mine))}


def max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


report = {}
cases = [(name, "ppo_clip", None) for name in AGGREGATIONS] + [
    ("seq_mean_token_mean", "gspo", None), ("token_sum_norm", "cispo", None),
    ("token_mean", "ppo_clip", "kl_reward+token_mask+entropy"),
    ("seq_mean_token_mean", "dual_clip", "kl_k2_loss+sequence_tis+warmup"),
]
for aggregation, policy, extra in cases:
    whole = run(aggregation, policy, False, EXTRAS.get(extra))
    split = run(aggregation, policy, True, EXTRAS.get(extra))
    report[f"{aggregation}/{policy}" + (f"/{extra}" if extra else "")] = {
        "lr": [whole["lr"], split["lr"]], "dropped": [whole["dropped"], split["dropped"]],
        "entropy": whole["entropy"], "kl": whole["kl"],
        "loss": [whole["loss"], split["loss"]],
        "grad_norm": [whole["grad_norm"], split["grad_norm"]],
        "grad_max_abs": whole["grad"].abs().max().item(),
        "grad_max_diff": (whole["grad"] - split["grad"]).abs().max().item(),
    }
# unequal micro-batch counts across the ranks (3 on rank 0, 1 on rank 1 per pass), through the log-prob passes
# of a masking correction and of the reference and through the update: each rank must agree on its padding
# passes before its first real one, or its collectives cross the other rank's FSDP all-gathers
masked = EXTRAS["kl_reward+token_mask+entropy"]
whole = run("token_mean", "ppo_clip", False, masked)
uneven = run("token_mean", "ppo_clip", False, masked, uneven=True)
report["uneven/one_minibatch"] = {
    "loss": [whole["loss"], uneven["loss"]], "grad_norm": [whole["grad_norm"], uneven["grad_norm"]],
    "grad_max_abs": whole["grad"].abs().max().item(), "grad_max_diff": max_diff(whole["grads"], uneven["grads"]),
    "dropped": [whole["dropped"], uneven["dropped"]],
}
# two minibatches of the uneven split (rank 0: 3 + 3 rows in micro-batches of 2, rank 1: 1 + 1), against the
# same rows in one micro-batch per minibatch (equal counts): the same permutations, so the same two updates
many = run("token_mean", "ppo_clip", False, masked, uneven=True, micro_batch_size=2, minibatches=2)
one = run("token_mean", "ppo_clip", False, masked, uneven=True, micro_batch_size=ROWS, minibatches=2)
report["uneven/two_minibatches"] = {
    "loss": [one["loss"], many["loss"]], "grad_norm": [one["grad_norm"], many["grad_norm"]],
    "grad_max_abs": max(g.abs().max().item() for g in one["grads"]), "grad_max_diff": max_diff(one["grads"], many["grads"]),
    "updates": [len(one["grads"]), len(many["grads"])], "dropped": [one["dropped"], many["dropped"]],
}
# micro-batches cut by a token budget (training.micro_batch_tokens): rows of 5 to 14 tokens, at most 30 padded
# tokens a pass, so rank 0's 6 rows take 3 passes and rank 1's 2 rows one; against one micro-batch a rank
budget = run("token_mean", "ppo_clip", False, masked, uneven=True, micro_batch_size=ROWS, micro_batch_tokens=30)
report["uneven/token_budget"] = {
    "loss": [whole["loss"], budget["loss"]], "grad_norm": [whole["grad_norm"], budget["grad_norm"]],
    "grad_max_abs": whole["grad"].abs().max().item(), "grad_max_diff": max_diff(whole["grads"], budget["grads"]),
    "dropped": [whole["dropped"], budget["dropped"]], "passes": [None] * world,
}
torch.distributed.all_gather_object(report["uneven/token_budget"]["passes"], budget["passes"])
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)
exit_ranks()
