"""The algorithm objects of a run, built from its config sections: the one place the config's names become
the typed choices of ``reflow.algorithms`` (which never read the config themselves)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reflow.algorithms.advantages import AdvantageEstimator
from reflow.algorithms.aggregation import Aggregation
from reflow.algorithms.off_policy import OffPolicyCorrection
from reflow.algorithms.policy_losses import PolicyLossSettings
from reflow.algorithms.schedules import LRSchedule

if TYPE_CHECKING:
    from reflow.config.job_config import JobConfig


def advantage_estimator(cfg: "JobConfig") -> AdvantageEstimator:
    section = cfg.advantage
    return AdvantageEstimator(section.estimator, section.eps, section.group_baseline)


def policy_loss(cfg: "JobConfig") -> PolicyLossSettings:
    loss = cfg.loss
    return PolicyLossSettings(
        name=loss.policy, clip_low=loss.clip_low, clip_high=loss.clip_high if loss.clip_high > 0 else loss.clip_low,
        dual_clip_c=loss.dual_clip_c, gspo_clip_low=loss.gspo_clip_low, gspo_clip_high=loss.gspo_clip_high,
        cispo_clip_low=loss.cispo_clip_low, cispo_clip_high=loss.cispo_clip_high,
    )


def aggregation(cfg: "JobConfig") -> Aggregation:
    tokens = cfg.loss.norm_tokens or cfg.rollout.max_new_tokens
    return Aggregation(cfg.loss.aggregation, float(tokens))


def off_policy_correction(cfg: "JobConfig") -> OffPolicyCorrection:
    section = cfg.off_policy
    return OffPolicyCorrection(section.correction, section.cap, section.band_low, section.band_high)


def updates_per_step(cfg: "JobConfig") -> int:
    return cfg.training.ppo_epochs * cfg.training.num_minibatches


def lr_schedule(cfg: "JobConfig") -> LRSchedule:
    training, per_step = cfg.training, updates_per_step(cfg)
    return LRSchedule(
        warmup_updates=training.warmup_steps * per_step, total_updates=training.steps * per_step,
        decay=training.lr_decay, min_ratio=training.min_lr_ratio,
    )
