"""The algorithm objects of a run, built from its config sections: the one place the config's names become
the typed choices of ``reflow.algorithms`` (which never read the config themselves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from reflow.algorithms.advantages import AdvantageEstimator
from reflow.algorithms.aggregation import Aggregation
from reflow.algorithms.off_policy import OffPolicyCorrection
from reflow.algorithms.policy_losses import PolicyLossSettings
from reflow.algorithms.schedules import LRSchedule

if TYPE_CHECKING:
    from reflow.config.job_config import JobConfig, KLSection, TrainingSection


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


def updates_per_step(training: "TrainingSection") -> int:
    return training.ppo_epochs * training.num_minibatches


def lr_schedule(training: "TrainingSection") -> LRSchedule:
    """The learning-rate schedule over optimizer updates (``training``: the run's [training] section)."""
    per_step = updates_per_step(training)
    return LRSchedule(
        warmup_updates=training.warmup_steps * per_step, total_updates=training.steps * per_step,
        decay=training.lr_decay, min_ratio=training.min_lr_ratio,
    )


@dataclass(frozen=True)
class Objective:
    """What the trainer optimizes, from [loss], [off_policy], [kl] and the sampling temperature: the one object
    ``PolicyTrainer`` takes instead of the whole config. ``kl`` is the [kl] section itself (beta, the
    estimator and where the penalty goes: already typed and checked)."""

    policy_loss: PolicyLossSettings
    aggregation: Aggregation
    correction: OffPolicyCorrection
    kl: "KLSection"
    entropy_coef: float
    temperature: float
    """The rollout's sampling temperature: the trainer's log-probs are those of the distribution sampled."""


def objective(cfg: "JobConfig") -> Objective:
    return Objective(
        policy_loss(cfg), aggregation(cfg), off_policy_correction(cfg),
        cfg.kl, cfg.loss.entropy_coef, cfg.rollout.temperature,
    )
