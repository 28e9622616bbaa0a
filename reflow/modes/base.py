"""What every training mode shares: the built components, the step loop, metrics, eval, checkpoints."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from reflow.algorithms.settings import advantage_estimator
from reflow.checkpoint import CheckpointManager
from reflow.config.job_config import JobConfig
from reflow.dataplane.collectives import reduce_stats
from reflow.distributed.placement import Placement
from reflow.metrics.logger import MetricsLogger
from reflow.metrics.timeline import NullTimeline, Timeline
from reflow.modes.prompts import PromptStream
from reflow.rewards import RewardMix
from reflow.rollout.engine import RolloutEngine
from reflow.rollout.groups import evaluate_share
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.rollout.turns import TurnDriver
from reflow.serving.drivers import AgentServing
from reflow.stopping import NonFiniteGuard, StopSignals
from reflow.tasks.base import Problem, Task
from reflow.trainer.policy import PolicyTrainer, StepStats
from reflow.types import AGENT_FAILURES as FAILURES
from reflow.types import ENGINE_WINDOW_KEYS, Sample, WorkerStats
from reflow.weight_sync.broadcast import WeightSync

if TYPE_CHECKING:
    from reflow.serving.agents import AgentDriver


@dataclass
class Components:
    """Everything a mode needs, built once by ``reflow.train.build_components``."""

    cfg: JobConfig
    rank: int
    world_size: int
    device: torch.device
    placement: Placement
    trainer: PolicyTrainer | None
    trainer_group: object
    engine: RolloutEngine
    turns: "TurnDriver | AgentDriver"
    """Runs requests through the engine and, for a multi-turn task, its environment between model turns."""
    weight_sync: WeightSync
    """The weight sync of the starting placement."""
    task: Task
    rewards: RewardMix
    """The run's reward: the [reward] section's weighted functions and shaping (the evaluation uses the task's)."""
    tokenizer: PromptTokenizer
    train_problems: list[Problem]
    eval_problems: list[Problem]
    logger: MetricsLogger
    timeline: "Timeline | NullTimeline"
    """This rank's spans (``reflow.metrics.timeline``)."""
    checkpoints: CheckpointManager
    layouts: dict
    """Trainer layouts (mesh and group) of every feasible placement, by trainer replica count."""
    weight_syncs: dict
    """The weight sync of every feasible placement, by trainer replica count."""
    schedule: list
    """Forced placement changes: (after step, trainer replicas), from placement.schedule."""
    stop_signals: StopSignals
    """SIGTERM / SIGUSR1 received so far: ``reflow.train`` installs it before the rank builds anything, so a
    signal during start-up (minutes of engine and model loading) stops the run after its first step."""
    agents: AgentServing | None = None
    """An agent task's endpoint and agent loop on this rank (``reflow.serving.drivers``)."""


class StepTimer:
    """Accumulates wall time per phase: ``with timer("gen"): ...``; each phase also goes on the rank's
    timeline (``reflow.metrics.timeline``) when one is given."""

    def __init__(self, timeline: "Timeline | NullTimeline | None" = None):
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}
        self.timeline = timeline or NullTimeline()

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            self.times[name] = self.times.get(name, 0.0) + elapsed
            self.timeline.add(name, wall, wall + elapsed)

    def get(self, name: str) -> float:
        return self.times.get(name, 0.0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class ModeBase:
    name = "base"
    max_staleness = 0
    """Largest staleness a trained sample can have in this mode (the length of ``staleness_counts`` - 1)."""
    staleness_anchor = "start"
    """The version a trained sample's staleness counts from ('finish' or 'start'; sync mode trains only 0)."""
    evaluates_in_loop = True
    """The train loop evaluates every metrics.eval_interval steps (every rank generates); the decoupled modes'
    rollout ranks evaluate at weight syncs instead, off the trainer's path."""

    def __init__(self, parts: Components):
        self.parts = parts
        self.version = 0
        self.step = 0
        self.stream = PromptStream(parts.train_problems, parts.cfg.job.seed, parts.cfg.task.shuffle)
        """The run's prompt stream, one for every mode: sync draws from its front, decoupled rollout workers by
        draw index (``reflow.modes.prompts``)."""
        self._drawn = 0
        self._train_start: float | None = None
        self.finished = False
        self.resumed_replicas: int | None = None
        """Trainer replicas when the checkpoint this run resumed from was saved."""
        self.stop_signals = parts.stop_signals
        """A SIGTERM or SIGUSR1 ends the run after the current step (``reflow.stopping``)."""
        self.nonfinite = NonFiniteGuard(parts.cfg.training.max_nonfinite_steps)
        self.stopped_by: str | None = None
        """Why the loop ended before training.steps: "time budget", a signal's name, or a non-finite error."""
        self.diverged: str | None = None

    # ---- data ---------------------------------------------------------------

    def next_prompts(self, n: int) -> list[tuple[int, Problem]]:
        """The next n prompts of the run's stream, each with its draw index (unique across the run)."""
        out = [(self._drawn + i, self.stream.problem_at(self._drawn + i)) for i in range(n)]
        self._drawn += n
        return out

    def _skip_prompts(self, n: int) -> None:
        self._drawn += n

    # ---- the loop -------------------------------------------------------------

    def train_one_step(self, step: int) -> dict:
        raise NotImplementedError(f"mode {self.name} must implement train_one_step")

    def resume(self) -> None:
        """Load the checkpoint on trainer ranks; every rank learns the step and joins the weight sync."""
        parts = self.parts
        extra = parts.checkpoints.maybe_load(parts.trainer)
        if extra is None:
            return
        self.step = int(extra["step"])
        self.version = int(extra["policy_version"])
        self._skip_prompts(int(extra.get("prompts_drawn", 0)))
        self.resumed_replicas = int(extra["trainer_replicas"])
        # the engines still hold the initial weights
        parts.weight_sync.sync(parts.trainer, parts.engine, self.version)
        parts.logger.info(f"resumed from step {self.step} (policy version {self.version})")

    def run(self) -> list[dict]:
        self.resume()
        return self.train_loop()

    def checkpoint_state(self) -> tuple[dict, dict[str, object]]:
        """What a checkpoint holds beside the trainer's state (every trainer rank calls, at a step's end): the
        extra state every rank gets back at resume (step, policy version, how far the prompt stream was read,
        trainer replicas), and this rank's own files (``CheckpointManager.save(files=...)``)."""
        extra = {
            "step": self.step, "policy_version": self.version, "prompts_drawn": self._drawn,
            "trainer_replicas": self.parts.trainer.layout.replicas,
        }
        return extra, {}

    @property
    def trainer_group(self):
        """The process group of the ranks that train now."""
        return self.parts.trainer_group

    def pause_requested(self, row: dict) -> bool:
        """After a step's row is logged, before its checkpoint (after every step but training.steps' last):
        leave the loop after this step, before the run is finished (a placement change)? After a step that
        stops the run early the answer is recorded by its checkpoint, not acted on (``finished`` is then set).
        Every rank that trains must get the same answer."""
        return False

    def train_loop(self) -> list[dict]:
        """Steps until training.steps (or training.time_budget_s), with logging, evaluation and checkpoints,
        or until ``pause_requested``; ``finished`` then tells which it was (called again, it goes on).

        Every rank that calls it trains (all ranks in colocated modes, the trainer ranks otherwise)."""
        parts = self.parts
        cfg = parts.cfg
        history = []
        if self.evaluates_in_loop and cfg.metrics.eval_interval and self.step == 0 and self.version == 0:
            # a new run scores its starting policy first (a row of its own at step 0), as the decoupled modes'
            # rollout ranks do: every run then has a baseline on the same held-out prompts
            parts.logger.log(0, {"eval_reward": self.evaluate(cfg.metrics.eval_num_prompts), "eval_policy_version": 0})
        if self._train_start is None:
            self._train_start = time.perf_counter()  # the time budget counts from the first step
        start = self._train_start
        self.finished = False
        while self.step < cfg.training.steps:
            self.step += 1
            row = self.train_one_step(self.step)
            row["mode"] = self.name
            if cfg.metrics.eval_interval and self.step % cfg.metrics.eval_interval == 0 and self.evaluates_in_loop:
                row["eval_reward"] = self.evaluate(cfg.metrics.eval_num_prompts)
                row["eval_policy_version"] = parts.engine.version  # the weights the engines hold (the last sync's)
            history.append(row)
            self.diverged = self.nonfinite.observe(self.step, row.get("skipped_updates", 0))
            stop = self._stop_reason(start)
            last = self.step == cfg.training.steps or stop is not None
            if stop is not None and self.step < cfg.training.steps:
                self.stopped_by = stop
            if self.step % cfg.metrics.log_freq == 0 or last:
                parts.logger.log(self.step, row)
            # the step's placement decision comes before its checkpoint, which records the outcome (a resumed run
            # takes up the placement this one is about to move to, and its controller has made the decision). A
            # run stopped early (time budget, signal) decides too, for the run that resumes it, but does not move
            pause = self.step < cfg.training.steps and self.pause_requested(row)
            if parts.checkpoints.should_save(self.step, last) and self.diverged is None:
                extra, files = self.checkpoint_state()
                path = parts.checkpoints.save(self.step, parts.trainer, extra, files)
                parts.logger.info(f"checkpoint saved: {path}")
            if last:
                self.finished = True
                break
            if pause:
                break
        return history

    def _stop_reason(self, start: float) -> str | None:
        """Stop after this step? Every trainer rank gets the same answer from one all-reduce(MAX) of
        [non-finite streak reached, training.time_budget_s reached (rank 0's clock: rank 0 trains in every
        placement), the highest-precedence stop signal any rank received] (``reflow.stopping``)."""
        budget = self.parts.cfg.training.time_budget_s
        out_of_time = budget > 0 and dist.get_rank() == 0 and time.perf_counter() - start >= budget
        flags = torch.tensor([int(self.diverged is not None), int(out_of_time), self.stop_signals.code])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.trainer_group)
        if flags[0]:
            return "non-finite updates"
        if flags[1]:
            return "time budget"
        if flags[2]:
            return StopSignals.name_of(int(flags[2]))  # the same name on every rank, whichever got the signal
        return None

    # ---- advantages -------------------------------------------------------------

    def first_use_advantages(self, fresh: list[Sample]) -> None:
        """The advantage estimator's batch stage (REINFORCE++: normalized over the step's fresh samples on every
        trainer rank), applied to samples trained for the first time; a replayed sample keeps the advantage it
        was first trained with. Every trainer rank calls it at the same point (one all-reduce)."""
        estimator = advantage_estimator(self.parts.cfg)
        if not estimator.normalizes_batch:
            return
        values = [s.advantage for s in fresh]
        summed = reduce_stats(
            {"count": len(values), "sum": sum(values), "squares": sum(v * v for v in values)}, self.trainer_group
        )
        count = max(summed["count"], 1.0)
        mean = summed["sum"] / count
        std = max(summed["squares"] / count - mean * mean, 0.0) ** 0.5
        normalized = estimator.batch_stage(torch.tensor(values, dtype=torch.float64), mean, std).tolist() if values else []
        for sample, value in zip(fresh, normalized):
            sample.advantage = value

    # ---- metrics ----------------------------------------------------------------

    def step_metrics(
        self,
        new_samples: list[Sample],
        trained: list[Sample],
        stats: StepStats,
        timer: StepTimer,
        trained_version: int,
        trainer_wait_s: float,
        engine_window: WorkerStats | None = None,
        loss_tokens: float = 0.0,
    ) -> dict:
        """Metrics of one step over the trainer ranks (all ranks in colocated modes).

        Rewards and lengths describe ``new_samples`` (first use: what the current policy generates);
        token throughput counts everything ``trained`` on (fresh and replayed); tool calls per sample, seconds
        per tool call (environment time, apart from engine time) and the share of response tokens the
        environment wrote (in context, never trained on) too. ``staleness_counts[k]``
        is how many trained samples were k versions older than the policy ``trained_version`` they
        trained. ``engine_window``: this rank's engine time and counts over the step (a colocated mode), summed
        over the ranks in the same reduction, under the decoupled rows' keys (``ENGINE_WINDOW_KEYS``); the
        rollout idle ratio is then the share of the ranks' step seconds their engines did not work (a rank
        waiting for a slower one's generation idles), as a decoupled mode's rollout window counts it. Without
        one the caller sets it from its rollout window.

        Figures that a throttled rollout cannot flatter: the trainer is idle while it waits for data and while it
        stalls in a weight sync (``sync_stall_ratio``, counted apart too: ``trainer_idle_ratio`` is their sum,
        ``trainer_wait_ratio`` the wait alone); ``loss_tokens_per_s`` counts ``loss_tokens``, this rank's tokens
        that carry loss weight with a replayed row's at its weight (``TrainBatch.loss_weighted_tokens``), beside
        ``tokens_per_s`` (every trained token, replayed and masked ones included); ``fresh_samples_per_s`` counts
        first uses only."""
        samples = new_samples
        staleness = [0] * (self.max_staleness + 1)
        for s in trained:
            age = s.staleness(trained_version, self.staleness_anchor)
            if not 0 <= age <= self.max_staleness:
                raise RuntimeError(f"sample {s.uid} trained at staleness {age}, outside [0, {self.max_staleness}]")
            staleness[age] += 1
        rewards = [s.reward for s in samples]
        agents = self.parts.cfg.task.name == "agent"
        part_names = self.parts.rewards.part_names
        summed = reduce_stats({
            **{f"reward_{name}": sum((s.reward_parts or {}).get(name, 0.0) for s in samples) for name in part_names},
            "reward": sum(rewards),
            "reward_squared": sum(r * r for r in rewards),
            "samples": len(samples),
            "response_tokens": sum(len(s.output_ids) for s in samples),
            "trainer_tokens": sum(len(s.prompt_ids) + len(s.output_ids) for s in trained),
            "loss_tokens": loss_tokens,
            "solved": sum(1 for s in samples if (s.reward_parts or {}).get("task", s.reward) >= 1.0),
            "truncated": sum(1 for s in samples if s.finish_reason == "length"),
            "tool_calls": sum(s.tool_calls for s in samples),
            "tool_s": sum(s.tool_s for s in samples),
            "env_tokens": sum(len(s.output_ids) - len(s.logprobs) for s in samples),
            "staleness": staleness,
            **({f"agent_{cause}": sum(1 for s in samples if s.agent_failure == cause) for cause in FAILURES}
               if agents else {}),
            **({"token_mismatches": sum(s.token_mismatches for s in samples)} if agents else {}),
            **({key: getattr(engine_window, field) for key, field in ENGINE_WINDOW_KEYS.items()} if engine_window else {}),
        }, self.trainer_group)
        longest = reduce_stats(
            {"response_len": max((len(s.output_ids) for s in samples), default=0)}, self.trainer_group, op="max",
        )
        n = max(summed["samples"], 1.0)
        step_time = timer.elapsed()
        mean = summed["reward"] / n
        staleness_counts = [int(x) for x in summed["staleness"]]
        return {
            "reward_mean": mean,
            "reward_std": max(summed["reward_squared"] / n - mean * mean, 0.0) ** 0.5,
            "solved_frac": summed["solved"] / n,
            "loss": stats.loss,
            "tokens_per_s": summed["trainer_tokens"] / max(step_time, 1e-9),
            "loss_tokens": summed["loss_tokens"],
            "loss_tokens_per_s": summed["loss_tokens"] / max(step_time, 1e-9),
            "fresh_samples_per_s": summed["samples"] / max(step_time, 1e-9),
            "step_time_s": step_time,
            "policy_version": self.version,
            "placement": self.parts.placement.name,
            "staleness_counts": staleness_counts,
            "staleness_max": max((k for k, n in enumerate(staleness_counts) if n), default=0),
            "num_samples": int(summed["samples"]),
            "trainer_tokens": int(summed["trainer_tokens"]),
            "response_len_mean": summed["response_tokens"] / n,
            "response_len_max": int(longest["response_len"]),
            "truncated_frac": summed["truncated"] / n,
            "tool_calls_mean": summed["tool_calls"] / n,
            "tool_latency_s": summed["tool_s"] / max(summed["tool_calls"], 1.0),
            "env_token_frac": summed["env_tokens"] / max(summed["response_tokens"], 1.0),
            "gen_time_s": timer.get("gen"),
            "train_time_s": timer.get("train"),
            "weight_sync_s": timer.get("sync"),
            "trainer_idle_ratio": (trainer_wait_s + timer.get("sync")) / max(step_time, 1e-9),
            "trainer_wait_ratio": trainer_wait_s / max(step_time, 1e-9),
            "sync_stall_ratio": timer.get("sync") / max(step_time, 1e-9),
            "rollout_idle_ratio": (
                max(0.0, 1.0 - summed["rollout_busy_s"] / (dist.get_world_size(self.trainer_group) * max(step_time, 1e-9)))
                if engine_window else 0.0
            ),
            **stats.as_row(),
            **({"agent_failed_frac": sum(summed[f"agent_{cause}"] for cause in FAILURES) / n,
                **{f"agent_{cause}": int(summed[f"agent_{cause}"]) for cause in FAILURES},
                "token_mismatches_mean": summed["token_mismatches"] / n} if agents else {}),
            **{f"reward_{name}_mean": summed[f"reward_{name}"] / n for name in part_names},
            **{key: summed[key] if key == "rollout_busy_s" else int(summed[key]) for key in ENGINE_WINDOW_KEYS if key in summed},
        }

    # ---- evaluation ----------------------------------------------------------------

    def evaluate(self, num_prompts: int) -> float:
        """Mean reward of one sample per held-out prompt, at the rollout temperature (every rank generates a share).

        A colocated rank's trainer state waits in host memory first, as for a step's generation: the engine
        wakes into the whole budget the memory plan gives it (at step 0 the parameters and AdamW moments would
        otherwise be resident, after a sync the parameters)."""
        parts = self.parts
        if parts.trainer is not None:
            parts.trainer.park("optimizer", "parameters")
        total, count = evaluate_share(parts, parts.turns, num_prompts, parts.rank, parts.world_size)
        summed = reduce_stats({"reward": total, "count": count}, None)
        return summed["reward"] / max(summed["count"], 1.0)

