"""The names of every algorithm choice, in one place and without torch: the config tree declares its choices
from these (``reflow.config.job_config``), and each algorithm object checks its name against them."""

from __future__ import annotations

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
POLICY_LOSSES = ("ppo_clip", "dual_clip", "gspo", "cispo")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
CORRECTIONS = ("token_tis", "sequence_tis", "token_mask", "sequence_mask", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("loss", "reward")
DECAYS = ("constant", "linear", "cosine")


def check_choice(what: str, name: str, known: tuple[str, ...]) -> None:
    """A ValueError naming ``what`` when ``name`` is not one of ``known``."""
    if name not in known:
        raise ValueError(f"unknown {what} {name!r} (known: {', '.join(known)})")
