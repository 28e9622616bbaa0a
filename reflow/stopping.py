"""Why a run stops before training.steps, decided the same way on every rank that trains.

Signals. Slurm preempts a job with SIGTERM (after ``--signal=USR1@<seconds>``, a warning, when asked), and
torchrun forwards SIGTERM (and, with ``--signals-to-handle``, SIGUSR1) to every rank, then kills them after
``--shutdown-timeout`` seconds. ``StopSignals`` turns either signal into a request: the handler only records
it (no I/O, nothing interrupted), and the train loop looks at it once per step, at the step's end, where
the state is consistent: every rank that trains all-reduces its request (MAX), so one rank's signal stops
them all at the same step. The run then saves a checkpoint (when checkpoint.enable), the rollout ranks of a
decoupled mode get Stop as at a normal end, and every rank exits 0. A rank that only generates waits for
that Stop: Slurm and torchrun signal every rank, so the trainer ranks have it too.

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

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: str | None = None

    def install(self) -> "StopSignals":
        for sig in self.SIGNALS:
            signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name


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
