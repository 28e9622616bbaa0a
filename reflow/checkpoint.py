"""Distributed checkpoints of the trainer (model and optimizer shards, step, policy version).

Saved with torch.distributed.checkpoint under <dump_folder>/<checkpoint.folder>/step-N,
over the process group of the ranks that train at that step (the placement may have changed since
startup; the checkpoint records the trainer replica count, and DCP reshards the state when a run
loads it onto another placement).

Writes are atomic: every rank writes into step-N.partial, and once DCP's save has returned on every rank
(its metadata written last, by the coordinator) rank 0 renames the folder to step-N. Only step-N folders
with their ``.metadata`` count, so a write killed at any point leaves the previous checkpoint the latest,
and the next save at that step clears the leftover. Then the oldest complete checkpoints beyond
checkpoint.keep_last are deleted (the folder is shared by the ranks, as DCP requires).
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from reflow.config.job_config import CheckpointSection


class CheckpointManager:
    def __init__(self, checkpoint: CheckpointSection, dump_folder: str):
        """``checkpoint``: the run's [checkpoint] section; its folder is relative to the run's ``dump_folder``."""
        self.enabled = checkpoint.enable
        self.interval = checkpoint.interval
        self.folder = os.path.join(dump_folder, checkpoint.folder)
        self.load_step = checkpoint.load_step
        self.keep_last = checkpoint.keep_last
        self.loaded_path: str | None = None
        """The checkpoint this run resumed from (``maybe_load``)."""

    def _path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def available_steps(self) -> list[int]:
        if not os.path.isdir(self.folder):
            return []
        steps = []
        for name in os.listdir(self.folder):
            m = re.fullmatch(r"step-(\d+)", name)
            if m and os.path.exists(os.path.join(self.folder, name, ".metadata")):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def check(self) -> None:
        """Before any rank starts: the checkpoint a resume would load exists, is complete and its metadata reads
        (a missing ``checkpoint.load_step``, or a corrupt one, is one error naming the key and the path)."""
        step = self.resume_step()
        if step is None:
            return
        steps = self.available_steps()
        if step not in steps:
            raise self._missing_load_step(steps)
        try:
            dcp.FileSystemReader(self._path(step)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure to read it means the same thing to the user
            raise ValueError(
                f"checkpoint.folder: the checkpoint {self._path(step)} is unreadable ({type(e).__name__}: {e}); "
                f"remove it to resume from an earlier one, or set checkpoint.load_step (available: {steps})"
            ) from None

    def resume_step(self) -> int | None:
        """The step a run resumes from (checkpoint.load_step, else the latest complete checkpoint), or None when it
        starts afresh; ``check`` (before any rank starts) and ``maybe_load`` (rank 0's choice) both ask it."""
        if not self.enabled:
            return None
        if self.load_step >= 0:
            return self.load_step
        steps = self.available_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int, last: bool) -> bool:
        return self.enabled and (step % self.interval == 0 or last)

    def save(self, step: int, trainer, extra: dict, files: dict[str, object] | None = None) -> str:
        """Every rank of ``trainer.group`` calls; returns the final path. ``files``: this rank's own state beside
        the DCP state (name -> picklable object; names must differ between ranks), written into the same
        folder before it is renamed complete."""
        state = {"trainer": trainer.state_dict(), "extra": dict(extra)}
        path = self._path(step)
        partial = path + ".partial"
        leader = dist.get_rank() == 0  # global rank 0 trains in every placement: it leads the trainer group
        if leader:
            shutil.rmtree(partial, ignore_errors=True)  # a killed write's leftover
            os.makedirs(self.folder, exist_ok=True)
        dist.barrier(group=trainer.group)
        dcp.save(state, checkpoint_id=partial, process_group=trainer.group)
        for name, obj in (files or {}).items():
            torch.save(obj, os.path.join(partial, f"{name}.pt"))
        dist.barrier(group=trainer.group)  # every rank's files are in; the metadata too
        if leader:
            if os.path.exists(path):  # saved at this step before (a rerun): replace it
                shutil.rmtree(path)
            os.replace(partial, path)
            self._prune()
        dist.barrier(group=trainer.group)
        return path

    def _prune(self) -> None:
        """Delete the oldest complete checkpoints beyond keep_last (rank 0, after a save)."""
        if self.keep_last <= 0:
            return
        for step in self.available_steps()[: -self.keep_last]:
            shutil.rmtree(self._path(step), ignore_errors=True)

    def _missing_load_step(self, steps: list[int]) -> ValueError:
        return ValueError(
            f"checkpoint.load_step = {self.load_step}: no complete checkpoint at {self._path(self.load_step)} "
            f"(available: {steps or 'none'})"
        )

    def _choose_step(self) -> int:
        """Rank 0 decides which step to load (-1: none) and tells every rank, so all load the same one."""
        choice = [-1]
        if dist.get_rank() == 0:
            step = self.resume_step()
            if step is not None:
                choice = [step if step in self.available_steps() else -2]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] == -2:
            raise self._missing_load_step(self.available_steps())
        return choice[0]

    def read_files(self, prefix: str) -> dict[str, object]:
        """The per-rank files (``save(files=...)``) of the checkpoint this run resumed from whose names start
        with ``prefix``, by name."""
        if self.loaded_path is None:
            return {}
        names = sorted(n[:-3] for n in os.listdir(self.loaded_path) if n.startswith(prefix) and n.endswith(".pt"))
        return {name: torch.load(os.path.join(self.loaded_path, f"{name}.pt"), weights_only=False) for name in names}

    def maybe_load(self, trainer) -> dict | None:
        """Load the requested (or latest) checkpoint into ``trainer`` (None, or inactive, on ranks that do not train).

        Every rank calls; every rank gets the checkpoint's extra state (step, policy version, prompts drawn)."""
        if not self.enabled:
            return None
        step = self._choose_step()
        if step < 0:
            return None
        self.loaded_path = self._path(step)
        extra = [None]
        if trainer is not None and trainer.active:
            state = {"trainer": trainer.state_dict(), "extra": {"step": 0, "policy_version": 0, "prompts_drawn": 0,
                                                                 "trainer_replicas": 0}}
            dcp.load(state, checkpoint_id=self._path(step), process_group=trainer.group)
            trainer.load_state_dict(state["trainer"])
            extra = [state["extra"]]
        dist.broadcast_object_list(extra, src=0)  # rank 0 is always a trainer rank
        return extra[0]
