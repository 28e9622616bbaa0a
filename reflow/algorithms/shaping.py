"""Reward shaping and sample filters from DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale"), sections 3.2-3.4.

  ``overlong_penalty``  soft overlong punishment (eq. 13): a response that runs into the last
                        ``buffer`` tokens before the length cap L loses reward linearly, reaching -1 at L
  ``has_signal``        dynamic sampling (eq. 11): a group whose outcome rewards (the reward before the
                        overlong shaping, ``reflow.rewards.outcome_reward``) are all equal has zero advantage
                        under every group baseline (GRPO, Dr. GRPO, RLOO, REINFORCE++ with its group
                        baseline), so it carries no gradient; it is dropped and generation goes on until the
                        batch's fresh share is filled
  overlong filtering    (section 3.3) truncated samples are masked out of the loss: ``loss.mask_truncated``,
                        applied where the batch is packed
"""

from __future__ import annotations

MAX_EXTRA_BATCHES = 8
"""Dynamic sampling's patience (DAPO's max_num_gen_batches): sync mode generates at most this many extra
rounds for a step's groups with signal; a decoupled trainer shard that receives this many batches' worth of
samples in a row without a group with signal stops the run (its trainer would otherwise wait forever)."""


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """R_length(y) of DAPO eq. 13 for a response of ``length`` tokens under a cap of ``max_tokens``:
    0 up to max_tokens - buffer, then ((max_tokens - buffer) - length) / buffer, -1 at and past the cap.
    ``buffer`` <= 0: no penalty."""
    if buffer <= 0:
        return 0.0
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    if length < max_tokens:
        return (free - length) / buffer
    return -1.0


def has_signal(rewards: list[float], tolerance: float = 1e-9) -> bool:
    """DAPO's dynamic-sampling condition 0 < |{correct}| < G, for any reward: not every reward equal."""
    return bool(rewards) and max(rewards) - min(rewards) > tolerance
