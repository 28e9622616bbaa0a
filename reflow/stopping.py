"""Why a run stops before training.steps, decided the same way on every rank that trains.

Signals. Slurm preempts a job with SIGTERM (after ``--signal=USR1@<seconds>``, a warning, when asked), and
torchrun forwards SIGTERM (and, with ``--signals-to-handle``, SIGUSR1) to every rank, then kills them after
``--shutdown-timeout`` seconds. ``StopSignals`` turns either signal into a request: the handler only records
it (no I/O, nothing interrupted; installed once the config checks pass, before the rank loads anything, so a
signal during start-up is recorded too), and the train loop looks at it once per step, at the step's end, where
the state is consistent: every rank that trains all-reduces its request (MAX of ``StopSignals.code``), so
one rank's signal stops them all at the same step, and every rank, rank 0 included, learns which signal it
was (``StopSignals.name_of``): Slurm's signal reaches the torchrun agents one by one, and rank 0, which
writes the stop record that decides whether the job requeues, may not have it yet when the others do.
The run then saves a checkpoint (when checkpoint.enable), the rollout ranks of a decoupled mode get Stop
as at a normal end, and every rank exits 0. A rank that only generates waits for that Stop: Slurm and
torchrun signal every rank, so the trainer ranks have it too.

Non-finite updates. ``NonFiniteGuard`` counts the steps in a row whose optimizer updates were skipped for a
non-finite loss or gradient (``PolicyTrainer`` skips such an update and keeps the last good state); after
training.max_nonfinite_steps of them the run stops with an error naming the step. The count comes from the
global gradient norm, the same on every trainer rank, so they all stop together.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass


class StopSignals:
    """Records SIGTERM / SIGUSR1 instead of dying on them (install on the main thread)."""

    # in rising precedence: when ranks got different signals, the all-reduce's MAX picks the later one. SIGTERM
    # (a cancel or a preemption) outranks SIGUSR1 (the time limit's warning, which requeues the job): a job
    # that is being cancelled must not requeue itself
    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.received: str | None = None

    def install(self) -> "StopSignals":
        for sig in self.SIGNALS:
            signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame) -> None:
        """Keep the highest-precedence signal so far: a cancel after the warning is a cancel."""
        if self.SIGNALS.index(signum) + 1 > self.code:
            self.received = signal.Signals(signum).name

    @property
    def code(self) -> int:
        """0 when no signal came, else the received signal's precedence (1 + its index in SIGNALS)."""
        names = [s.name for s in self.SIGNALS]
        return names.index(self.received) + 1 if self.received else 0

    @classmethod
    def name_of(cls, code: int) -> str | None:
        """The signal a (reduced) ``code`` stands for; None for 0."""
        return cls.SIGNALS[code - 1].name if code else None


@dataclass
class NonFiniteGuard:
    """Steps in a row with a skipped (non-finite) update; ``observe`` returns an error once there are ``limit``."""

    limit: int
    streak: int = 0

    def observe(self, step: int, skipped_updates: int) -> str | None:
        self.streak = self.streak + 1 if skipped_updates else 0
        if self.limit and self.streak >= self.limit:
            return (
                f"training.max_nonfinite_steps = {self.limit}: steps {step - self.streak + 1}..{step} each had a "
                f"non-finite loss or gradient (their updates were skipped); stopping. Lower training.lr, check the "
                f"rewards for NaN, or resume from an earlier checkpoint"
            )
        return None
