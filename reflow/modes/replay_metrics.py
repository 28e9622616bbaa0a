"""What the replay cycle did in a live step, over the trainer ranks (the metrics the step rows and the modes
benchmark report beside the trainer's own: ``ModeBase.step_metrics``)."""

from __future__ import annotations

import torch.distributed as dist

from reflow.algorithms.aggregation import replay_gradient_share
from reflow.config.mode_settings import ModeSettings
from reflow.dataplane.collectives import reduce_stats
from reflow.modes.ledger import EVICTION_CAUSES, FILTERED
from reflow.modes.trainer_shard import TrainerShard
from reflow.replay.buffer import BatchPlan


def survival_by_decile(retired: list[tuple[int, bool]]) -> list[float]:
    """``retired``: (response length, trained fresh) per retired sample. Ten equal-count bins by length, shortest
    first: the share of each bin trained fresh (empty when fewer than ten samples retired)."""
    if len(retired) < 10:
        return []
    ordered = sorted(retired)
    bins = [ordered[len(ordered) * k // 10 : len(ordered) * (k + 1) // 10] for k in range(10)]
    return [sum(kept for _, kept in b) / len(b) for b in bins]


def replay_cycle_metrics(
    shard: TrainerShard, plan: BatchPlan, trained_version: int, model_tokens: int, masked: int, settings: ModeSettings,
    group,
) -> dict:
    """What the replay cycle did in this step, over the trainer ranks: fresh and replayed samples, what arrived
    (its count, response length and reward, evicted samples included: ``reward_mean`` is over trained ones),
    unused samples evicted by cause, the head lag of the fresh samples (versions their oldest token is behind
    the trained policy), the model tokens masked for lagging more than max_head_lag, and survival (trained
    fresh / retired) per decile of response length among the samples retired since the previous step (those
    dynamic sampling filtered left out), and the share of what arrived that dynamic sampling filtered
    (evicted "no_signal"; 0 when it is off); ``alpha``, the replayed rows' share of the gradient at weight tau.
    Head lags go in max(delta, max_head_lag) + 2 buckets, the last one holding every lag beyond the others."""
    window = shard.take_window()
    head_lags = [0] * (max(settings.delta, settings.max_head_lag or 0) + 2)
    for sample in plan.fresh:
        head_lags[min(sample.head_lag(trained_version), len(head_lags) - 1)] += 1
    total = reduce_stats(
        {
            "fresh": len(plan.fresh), "replayed": len(plan.replayed), "received": window.received,
            "received_tokens": window.received_tokens, "received_reward": window.received_reward,
            "model_tokens": model_tokens, "masked": masked, "head_lags": head_lags,
            **{f"evicted_{cause}": window.evicted[cause] for cause in EVICTION_CAUSES},
        },
        group,
    )
    buffered = reduce_stats({"size": len(shard.buffer)}, group, op="max")["size"]
    retired: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(retired, window.retired_lengths, group=group)
    fresh, replayed, received = int(total["fresh"]), int(total["replayed"]), int(total["received"])
    evicted = {cause: int(total[f"evicted_{cause}"]) for cause in EVICTION_CAUSES}
    return {
        "fresh_samples": fresh,
        "replayed_samples": replayed,
        "replay_fraction": replayed / max(fresh + replayed, 1),
        "alpha": replay_gradient_share(replayed / max(fresh + replayed, 1), settings.tau),
        "received_samples": received,
        # what the engines generated, before staleness eviction (response_len_mean is over trained samples)
        "received_response_len_mean": total["received_tokens"] / received if received else 0.0,
        "received_reward_mean": total["received_reward"] / received if received else 0.0,
        "masked_token_frac": total["masked"] / total["model_tokens"] if total["model_tokens"] else 0.0,
        "evicted_unused": sum(evicted.values()),
        **{f"evicted_{cause}": count for cause, count in evicted.items()},
        "dynamic_sampling_filtered_frac": evicted[FILTERED] / received if received else 0.0,
        "head_lag_counts": [int(x) for x in total["head_lags"]],
        "survival_by_length_decile": survival_by_decile([pair for part in retired for pair in part]),
        "buffer_size_max": int(buffered),
    }
