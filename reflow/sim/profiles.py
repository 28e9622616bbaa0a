"""Cost models for the simulator: what an engine step, a trainer step, a weight sync and a placement change
cost on some hardware. Named profiles ship here; ``fit_profile`` builds one from a real run's metrics.jsonl.

Engine step over n running sequences holding C context tokens, admitting p prompt tokens:

    step_s = step_overhead_s + n x decode_token_s + C x context_token_s + p x prefill_token_s

Trainer step on one trainer rank holding T tokens of the batch: train_overhead_s + T x train_token_s, plus
train_collective_s when the trainer has more than one rank. T counts the rank's prompt and response tokens, or
(a profile fitted on runs that log ``train_pass_tokens``) the token slots of its forward/backward passes:
``CostProfile.charged_tokens``.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace

from reflow.distributed.placement import parse_placement_name


@dataclass(frozen=True)
class CostProfile:
    name: str
    source: str
    """Where the numbers come from."""
    step_overhead_s: float
    decode_token_s: float
    context_token_s: float
    prefill_token_s: float
    kv_budget_tokens: int
    """KV-cache tokens per engine (one GPU, or one CPU rank)."""
    kv_block_size: int
    max_num_seqs: int
    train_overhead_s: float
    train_token_s: float
    """Seconds per token on one trainer rank (forward, backward, the extra log-prob forward, optimizer)."""
    train_collective_s: float
    """Added to a trainer step when the trainer has more than one rank (FSDP gathers and reductions)."""
    weight_sync_s: float
    """The trainer's seconds per weight sync: its gather and the broadcast to the rollout ranks (a colocated sync
    reloads its own engine after that: ``worker_sync_s`` more)."""
    transition_s: float
    step_fixed_s: float = 0.0
    """The trainer's seconds a step outside waiting, the train step and the weight sync (the batch packed, the
    readiness exchange, the step's metrics reduced over the ranks)."""
    worker_tick_s: float = 0.0
    """A rollout worker's seconds per decode step outside the engine step, neither busy nor idle (its
    commands polled, admission, its report)."""
    worker_sync_s: float = 0.0
    """A rollout worker's seconds per weight sync beyond the broadcast the trainer times (the engine's reload):
    its requests in flight wait them out, neither busy nor idle."""
    train_token_basis: str = "tokens"
    """What ``train_token_s`` is per: "tokens", a rank's prompt and response tokens, or "pass_slots", the token
    slots of its forward/backward passes as the live trainer plans them (``plan_micro_batches``: rows grouped by
    length, each pass padded to its longest row; the live rows' ``train_pass_tokens``). On the long-tailed
    rollout-bound bench a pass of 32 rows computes 1.6x the rows' tokens on one trainer rank and 2.5x on each of
    two (fewer rows a rank, so each pass is padded to a rarer maximum): per token, a 2-rank sync trainer is
    1.8x slower than async's 1-rank one, which a per-token cost fitted on async cannot see."""
    train_time_ratios: tuple[float, ...] = ()
    """Measured train-step seconds over the fit's prediction, one per step: a simulated step's train time is
    the prediction times one of them, drawn at random (none: exactly the prediction). On a loaded machine a
    step's time varies by a quarter or more, and that noise decides whether generation keeps up with a
    short step: a trainer of constant speed locks reflow into alternating full and half-replayed batches
    the live system leaves."""

    def train_seconds(self, tokens_per_rank: int, ranks: int, rng: random.Random) -> float:
        """One trainer step's train seconds: its slowest rank's tokens, the collectives when there are several
        ranks, times a measured ratio when the profile has them."""
        seconds = self.train_overhead_s + tokens_per_rank * self.train_token_s
        if ranks > 1:
            seconds += self.train_collective_s
        return seconds * (rng.choice(self.train_time_ratios) if self.train_time_ratios else 1.0)

    def charged_tokens(self, row_tokens: list[int], micro_batch_size: int, micro_batch_tokens: int = 0) -> int:
        """The T of ``train_seconds`` for one rank's rows (each row's prompt and response tokens): their sum, or
        under the "pass_slots" basis the slots of the passes ``plan_micro_batches`` makes of them (a simulation
        that does not know the micro-batch size, 0, charges the sum). The zero-weight passes that keep the
        ranks' pass counts equal are left out (a row of one prompt each)."""
        if self.train_token_basis != "pass_slots" or micro_batch_size < 1 or not row_tokens:
            return sum(row_tokens)
        from reflow.trainer.batch import plan_micro_batches  # (torch: only where a profile charges passes)

        return sum(
            len(rows) * max(row_tokens[i] for i in rows)
            for rows in plan_micro_batches(row_tokens, micro_batch_size, micro_batch_tokens)
        )

    def step_seconds(self, sequences: int, context_tokens: int, prefill_tokens: int = 0) -> float:
        return (
            self.step_overhead_s + sequences * self.decode_token_s + context_tokens * self.context_token_s
            + prefill_tokens * self.prefill_token_s
        )

    def as_dict(self) -> dict:
        return asdict(self)


# Qwen3-8B (36 layers, 8 KV heads of 128: 147 KB of bf16 KV per token; 8.2B parameters, 16.4 GB in bf16) on
# H800 SXM GPUs (989 TFLOP/s dense bf16, 3.35 TB/s HBM3; NVIDIA's datasheet), one engine per GPU:
#   step overhead   the weights read once per decode step at ~60% of HBM bandwidth: 16.4 GB / 2.0 TB/s
#   decode token    2 x 8.2e9 FLOPs per token at 50% of peak
#   context token   147 KB of KV read per context token per step at 2.0 TB/s
#   prefill token   as a decode token (compute-bound)
#   KV budget       ~50 GB left at gpu_memory_utilization 0.9 after weights and activations: 340k tokens
#   trainer token   8 x 8.2e9 FLOPs (6N for forward + backward, 2N for the old log-probs) at 40% MFU, the
#                   figure torchtitan reports for FSDP2 on H100-class GPUs; collectives not hidden by the
#                   overlap: 0.5 s a step
#   weight sync     16.4 GB broadcast over the rollout pool (~3 s); transition: the paper's 5.72 s (16:16 -> 24:8
#                   on 32 GPUs)
QWEN3_8B_H800 = CostProfile(
    name="qwen3-8b-h800",
    source="derived from published hardware and model numbers (see reflow/sim/profiles.py); not measured",
    step_overhead_s=16.4e9 / 2.0e12,
    decode_token_s=2 * 8.2e9 / (0.5 * 989e12),
    context_token_s=147e3 / 2.0e12,
    prefill_token_s=2 * 8.2e9 / (0.5 * 989e12),
    kv_budget_tokens=340_000,
    kv_block_size=16,
    max_num_seqs=256,
    train_overhead_s=1.0,
    train_token_s=8 * 8.2e9 / (0.4 * 989e12),
    train_collective_s=0.5,
    weight_sync_s=3.0,
    transition_s=5.72,
)

# The tiny Qwen3 on this project's 2-core CPU machines, one rank per core (job.cpu_affinity): fitted with
# ``python -m reflow.sim fit --warmup-steps 5`` from the twelve runs of the modes benchmark on 2026-12-07
# (train_configs/bench_modes.toml, 2 ranks, every mode, seeds 0-2), per token slot of the trainer's passes.
# Its train_collective_s (a 2-rank trainer's seconds a step beyond its busiest rank's slots, from the sync runs)
# is what a fit on a 1-rank trainer (async's) cannot see and takes from here.
TINY_CPU = CostProfile(
    name="tiny-cpu",
    source="python -m reflow.sim fit --warmup-steps 5 --metrics <bench_modes.toml: sync, one_step_off, async and "
    "reflow, seeds 0-2>/metrics.jsonl (2026-12-07); transition_s from tiny_elastic's transitions",
    step_overhead_s=0.00133,
    decode_token_s=9.63e-05,
    context_token_s=0.0,
    prefill_token_s=3.03e-05,
    kv_budget_tokens=500_000,
    kv_block_size=128,
    max_num_seqs=256,
    train_overhead_s=0.0,
    train_token_s=9.32e-05,
    train_collective_s=0.0479,
    weight_sync_s=0.00629,
    transition_s=0.3,
    step_fixed_s=0.00112,
    worker_tick_s=0.000102,
    worker_sync_s=0.0138,
    train_token_basis="pass_slots",
)

PROFILES = {profile.name: profile for profile in (TINY_CPU, QWEN3_8B_H800)}


def _least_squares(rows: list[tuple[float, ...]], targets: list[float]) -> list[float]:
    """Non-negative least squares for a handful of columns (clip and refit the free ones)."""
    import numpy as np

    matrix, target = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    free = list(range(matrix.shape[1]))
    solution = np.zeros(matrix.shape[1])
    while free:
        coef, *_ = np.linalg.lstsq(matrix[:, free], target, rcond=None)
        if (coef >= 0).all():
            solution[free] = coef
            break
        free = [column for column, c in zip(free, coef) if c > 0]
    return solution.tolist()


def fit_profile(metrics_paths: list[str], name: str, base: CostProfile = TINY_CPU, warmup_steps: int = 0) -> CostProfile:
    """A profile from real runs' metrics.jsonl files (several modes of one benchmark, or one run), their rows
    after step ``warmup_steps`` (the first steps compile and warm caches: seconds, against tenths after):

      engine    busy seconds of each rollout window against its engine steps, the tokens they sampled (one per
                running sequence a step: what the simulated engine charges ``decode_token_s`` for) and,
                where every window reports them, the tokens prefilled (new prompts, and the prefix of every
                held request again after a weight sync): a decoupled run's rows carry rollout_engine_steps,
                rollout_sampled_tokens and rollout_prefilled_tokens for each report window, a sync run's for
                each step's generation (its engines, summed over the ranks). A run from before
                rollout_sampled_tokens was logged is fitted on rollout_step_sequences instead, the requests in
                flight summed over the steps: queued ones included, so on a KV-bound run a per-sequence cost fitted
                on it is many times too small for the running sequences it is charged on
      trainer   train_time_s of each step against 1, the token slots of its busiest rank's passes
                (``train_pass_tokens``, where every step logs them; else its tokens per trainer rank) and whether the trainer had
                more than one rank (the collectives); each step's measured time over that prediction (the
                noise a simulated step draws from); the median of the step's seconds outside its wait, its
                train step and its sync (the fixed costs)
      worker    a decoupled run's rollout seconds per weight sync beyond the trainer's, and its seconds
                neither busy, idle nor syncing, per decode step
      sync      the mean weight_sync_s of the decoupled steps that synced; a colocated run's (sync mode's) sync
                is the gather and its own engine's reload, one after the other, so from colocated runs only
                it is their mean sync with no worker seconds beyond it (the split cannot be told apart)

    Fields the runs cannot tell (KV budget, block size, the context cost, the prefill cost of runs that did not
    report it, a transition when none happened) keep ``base``'s values."""
    runs = [
        [row for row in map(json.loads, open(path)) if row.get("step", warmup_steps + 1) > warmup_steps]
        for path in metrics_paths
    ]
    rows = [row for run in runs for row in run]
    windows = [r for r in rows if r.get("rollout_engine_steps")]
    steps = [r for r in rows if _is_step(r)]
    if len(windows) < 3 or len(steps) < 3:
        raise ValueError(
            f"{', '.join(metrics_paths)}: need at least 3 steps of a run with rollout windows "
            f"(found {len(windows)} windows, {len(steps)} steps)"
        )
    prefills = all("rollout_prefilled_tokens" in r for r in windows)
    sampled = "rollout_sampled_tokens" if all("rollout_sampled_tokens" in r for r in windows) else "rollout_step_sequences"
    engine = _least_squares(
        [(r["rollout_engine_steps"], r[sampled], *([r["rollout_prefilled_tokens"]] if prefills else []))
         for r in windows],
        [r["rollout_busy_s"] for r in windows],
    )
    overhead, per_sequence = engine[:2]
    prefill = engine[2] if prefills else base.prefill_token_s
    ranks = [trainer_ranks(r["placement"]) for r in steps]
    # per token slot of the busiest rank's passes where every step logs them, else per token of a rank's mean share
    passes = all("train_pass_tokens" in r for r in steps)
    columns = [
        (1.0, r["train_pass_tokens"] if passes else r["trainer_tokens"] / n, 1.0 if n > 1 else 0.0)
        for r, n in zip(steps, ranks)
    ]
    if not any(c[2] for c in columns):
        columns = [c[:2] for c in columns]
    coefficients = _least_squares(columns, [r["train_time_s"] for r in steps])
    train_overhead, per_token = coefficients[:2]
    collective = coefficients[2] if len(coefficients) > 2 else base.train_collective_s
    # each step's time over the prediction, scaled so that the simulated steps' mean is the measured mean (the
    # non-negative fit's line need not pass through it, nor the mean of ratios equal the ratio of means)
    predicted = [sum(c * x for c, x in zip(coefficients, column)) for column in columns]
    pairs = [(r["train_time_s"], p) for r, p in zip(steps, predicted) if p > 0]
    raw = [actual / p for actual, p in pairs]
    scale = (sum(actual for actual, _ in pairs) / sum(p for _, p in pairs)) / (sum(raw) / len(raw)) if raw else 1.0
    ratios = tuple(round(ratio * scale, 3) for ratio in raw)
    decoupled = [r for r in steps if parse_placement_name(r["placement"]).num_rollout_ranks > 0]
    syncs = [r["weight_sync_s"] for r in (decoupled or steps) if r["weight_sync_s"] > 0]
    # the trainer's step outside its wait (a decoupled trainer's, or sync mode's generation), its train step and
    # its sync: the median, as a step that evaluates or checkpoints is an outlier
    outside = sorted(
        r["step_time_s"] - r["train_time_s"] - r["weight_sync_s"] - r.get("trainer_wait_s", r.get("gen_time_s", 0.0))
        for r in steps
    )
    step_fixed = max(0.0, outside[len(outside) // 2])
    weight_sync = sum(syncs) / len(syncs) if syncs else base.weight_sync_s
    # a rollout worker's seconds per sync beyond the broadcast, from the runs whose workers time their syncs (a
    # colocated sync's reload is inside its weight_sync_s already)
    worker_syncs = sum(r.get("rollout_syncs", 0) for r in rows)
    if worker_syncs:
        worker_sync = max(0.0, sum(r.get("rollout_sync_s", 0.0) for r in rows) / worker_syncs - weight_sync)
    elif decoupled:
        worker_sync = base.worker_sync_s
    else:
        worker_sync = 0.0
    # a rollout worker's wall time neither busy, idle nor syncing, per decode step, over each decoupled run (its
    # windows close about once a second, not with the steps): its rollout ranks live the steps' seconds (a
    # run whose workers do not time their syncs: less the trainer's sync seconds)
    unaccounted, ticks = 0.0, 0
    for run in runs:
        run_steps = [r for r in run if _is_step(r)]
        if not any("rollout_idle_s" in r for r in run) or not run_steps:
            continue
        rollout_ranks = [parse_placement_name(r["placement"]).num_rollout_ranks for r in run_steps]
        timed = any("rollout_sync_s" in r for r in run)
        syncing = (
            sum(r.get("rollout_sync_s", 0.0) for r in run) if timed
            else sum(r["weight_sync_s"] * ranks for r, ranks in zip(run_steps, rollout_ranks))
        )
        unaccounted += sum(r["step_time_s"] * ranks for r, ranks in zip(run_steps, rollout_ranks)) - syncing - sum(
            r.get("rollout_busy_s", 0.0) + r.get("rollout_idle_s", 0.0) for r in run
        )
        ticks += sum(r.get("rollout_engine_steps", 0) for r in run)
    worker_tick = max(0.0, unaccounted / ticks) if ticks else base.worker_tick_s
    changes = [r["transition_s"] for r in rows if "transition_s" in r]
    return CostProfile(
        name=name,
        source=f"fitted from {', '.join(metrics_paths)} ({len(windows)} rollout windows, {len(steps)} steps)",
        step_overhead_s=overhead,
        decode_token_s=per_sequence,
        context_token_s=base.context_token_s,
        prefill_token_s=prefill,
        kv_budget_tokens=base.kv_budget_tokens,
        kv_block_size=base.kv_block_size,
        max_num_seqs=base.max_num_seqs,
        train_overhead_s=train_overhead,
        train_token_s=per_token,
        train_collective_s=collective,
        train_token_basis="pass_slots" if passes else "tokens",
        weight_sync_s=weight_sync,
        transition_s=sum(changes) / len(changes) if changes else base.transition_s,
        step_fixed_s=step_fixed,
        worker_tick_s=worker_tick,
        worker_sync_s=worker_sync,
        train_time_ratios=ratios,
    )


def with_engine_settings(profile: CostProfile, rollout) -> CostProfile:
    """``profile`` with the engine limits a config's ``[rollout]`` section sets: its KV cache ((num_kv_blocks - 1) x
    kv_block_size tokens, when num_kv_blocks is set: a KV-bound workload) and max_num_seqs. A fitted profile
    knows the costs of a step, not the limits the run was given: those come from the config it ran. vLLM keeps
    one of the num_kv_blocks as its null block (``BlockPool.null_block``, never allocated): the sequences share
    the rest."""
    block = rollout.kv_block_size or profile.kv_block_size
    budget = (rollout.num_kv_blocks - 1) * block if rollout.num_kv_blocks else profile.kv_budget_tokens
    return replace(profile, kv_block_size=block, kv_budget_tokens=budget, max_num_seqs=rollout.max_num_seqs)


def _is_step(row: dict) -> bool:
    """A trainer step's row (not a rollout window's, an evaluation's or a placement change's)."""
    return "train_time_s" in row and "placement" in row


def trainer_ranks(placement: str) -> int:
    """Trainer ranks of a placement name: "T2x1+R2" -> 2, a colocated run of 2 ranks "T1x2+R0" -> 2."""
    return parse_placement_name(placement).num_trainer_ranks
