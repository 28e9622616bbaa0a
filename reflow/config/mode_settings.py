"""What each decoupled mode implies for replay, staleness, weight sync and dispatch (``resolve_settings``),
in one place and free of torch.distributed, so the live modes, config validation and the simulator share it.
The reasoning behind each mode's rule is in docs/decoupled_protocol.md."""

from __future__ import annotations

from dataclasses import dataclass

from reflow.config.job_config import JobConfig, ReplaySection, RolloutSection, TrainingSection, WeightSyncSection
from reflow.replay.buffer import min_fresh
from reflow.scheduler.dispatch import DispatchRule


@dataclass(frozen=True)
class ModeSettings:
    sigma: float
    tau: float
    delta: int
    interval: int
    min_staleness: int
    """A shard trains an unused sample only once it is at least this stale (one_step_off: 1)."""
    steps_ahead: int
    """Batches generation may run ahead of the one being trained: the window is (steps_ahead + 1) batches."""
    dispatch: DispatchRule
    anchor: str
    """The version staleness counts from: 'finish' (the group's completion) or 'start' (its oldest token)."""
    max_head_lag: int | None
    """Model tokens more than this many versions behind the trained policy are masked out (None: no mask)."""
    first_tokens_before_sync: bool = False
    """Before a weight sync (or a placement change) a rollout worker steps its engine until every admitted
    request has a token, so a sample's oldest token comes from the version it was admitted under (I1).
    one_step_off needs it for its exactness (every trained sample exactly one version old, counted from the
    start); async and reflow do not: a request without a token waits in the queue across the sync and is born
    under the newer weights, fresher and never staler, and the trainers do not wait for those prefill steps."""


def resolve_settings(cfg: JobConfig) -> ModeSettings:
    """``mode_settings`` of a run's config."""
    return mode_settings(cfg.training, cfg.replay, cfg.weight_sync, cfg.rollout)


def mode_settings(
    training: TrainingSection, replay: ReplaySection, weight_sync: WeightSyncSection, rollout: RolloutSection,
) -> ModeSettings:
    """The replay, staleness, sync and dispatch settings each decoupled mode implies, from the sections that
    decide them (one place, no hidden rewrites of the config)."""
    batch = training.prompts_per_step * training.group_size
    if training.mode == "one_step_off":
        # verl's one-step-off: the batch the previous policy began, so staleness counts from the start and is 1
        return ModeSettings(
            sigma=0.0, tau=1.0, delta=1, interval=1, min_staleness=1, steps_ahead=1, dispatch=DispatchRule(window=2 * batch),
            anchor="start", max_head_lag=None, first_tokens_before_sync=True,
        )
    if training.mode not in ("async", "reflow"):
        raise ValueError(f"training.mode {training.mode!r} is not a decoupled mode")
    interval = weight_sync.interval
    steps_ahead = replay.delta - interval + 1
    window = (steps_ahead + 1) * batch
    common = dict(
        delta=replay.delta, interval=interval, min_staleness=0, steps_ahead=steps_ahead, anchor=replay.staleness_from,
        max_head_lag=replay.max_head_lag or 2 * replay.delta,
    )
    if training.mode == "async":
        return ModeSettings(sigma=0.0, tau=1.0, dispatch=DispatchRule(window=window), **common)
    # reflow admits as far ahead as async (the rollout never idles more than async's), bounded per step by B_max;
    # a step may retire as few as ceil(b (1 - sigma)) fresh samples (the rest of its batch replayed), not b, so
    # replay.strict_window narrows the window to steps_ahead batches plus that floor, in whole groups: then
    # nothing can outlive its bound unused (docs/decoupled_protocol.md: both guarantees, the worst case found)
    if replay.strict_window:
        floor_groups = min_fresh(batch, replay.sigma) // training.group_size
        window = steps_ahead * batch + floor_groups * training.group_size
    return ModeSettings(
        sigma=replay.sigma, tau=replay.tau, dispatch=DispatchRule(window=window, per_step=rollout.b_max or batch),
        **common,
    )
