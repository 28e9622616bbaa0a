"""What each decoupled mode implies for replay, staleness, weight sync and dispatch (``resolve_settings``),
in one place and free of torch.distributed, so the live modes, config validation and the simulator share it.
The reasoning behind each mode's rule is in ``reflow.modes.decoupled``'s essay."""

from __future__ import annotations

from dataclasses import dataclass

from reflow.config.job_config import JobConfig
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
    """Window modes: batches generation may run ahead of the one being trained (0 for reflow)."""
    dispatch: DispatchRule


def resolve_settings(cfg: JobConfig) -> ModeSettings:
    """The replay, staleness, sync and dispatch settings each decoupled mode implies (one place, no hidden
    rewrites of the config)."""
    training, replay = cfg.training, cfg.replay
    batch = training.prompts_per_step * training.group_size
    if training.mode == "one_step_off":
        return ModeSettings(
            sigma=0.0, tau=1.0, delta=1, interval=1, min_staleness=1, steps_ahead=1, dispatch=DispatchRule(window=2 * batch)
        )
    if training.mode == "async":
        interval = cfg.weight_sync.interval
        steps_ahead = replay.delta - interval + 1
        return ModeSettings(
            sigma=0.0, tau=1.0, delta=replay.delta, interval=interval, min_staleness=0, steps_ahead=steps_ahead,
            dispatch=DispatchRule(window=(steps_ahead + 1) * batch),
        )
    if training.mode == "reflow":
        return ModeSettings(
            sigma=replay.sigma, tau=replay.tau, delta=replay.delta, interval=cfg.weight_sync.interval, min_staleness=0,
            steps_ahead=0, dispatch=DispatchRule(per_step=cfg.rollout.b_max or batch),
        )
    raise ValueError(f"training.mode {training.mode!r} is not a decoupled mode")
