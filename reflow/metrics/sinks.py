"""Where rank 0's metric rows go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

A row holds scalars and lists. Each sink gets both: a scalar as a scalar, a list of numbers as a histogram (a
key ending in ``_counts`` holds counts per value, 0, 1, 2, ...: ``staleness_counts``; any other list holds the
values themselves: ``survival_by_length_decile``), never dropped.

Weights & Biases (``metrics.wandb_project`` set): the run's config goes with the run; the run's id is kept in
``<dump_folder>/wandb_run_id``, so a resumed run continues the same W&B run (``resume="allow"``);
``metrics.wandb_mode = "offline"`` writes under ``<dump_folder>/wandb`` for a later ``wandb sync`` (a node
without network).
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any


def split_row(row: dict[str, Any]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(scalars, histograms' values) of a row: finite numbers, and lists of numbers (see the module's docstring)."""
    scalars, series = {}, {}
    for key, value in row.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            scalars[key] = float(value)
        elif (
            isinstance(value, (list, tuple)) and value
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            if key.endswith("_counts"):
                series[key] = [float(index) for index, count in enumerate(value) for _ in range(int(count))]
            else:
                series[key] = [float(v) for v in value if math.isfinite(v)]
    return scalars, {key: values for key, values in series.items() if values}


class TensorBoardSink:
    def __init__(self, dump_folder: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(dump_folder, "tb"))

    def write(self, step: int, scalars: dict[str, float], series: dict[str, list[float]]) -> None:
        import numpy as np

        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        for key, values in series.items():
            self.writer.add_histogram(key, np.asarray(values), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True)
class WandbSettings:
    """``[metrics]``'s W&B keys (``reflow.config.job_config.MetricsSection``)."""

    project: str
    entity: str = ""
    run_name: str = ""
    group: str = ""
    tags: tuple[str, ...] = field(default=())
    mode: str = "online"


class WandbSink:
    """One W&B run per training run, continued on resume."""

    ID_FILE = "wandb_run_id"

    def __init__(self, settings: WandbSettings, dump_folder: str, config: dict):
        import wandb

        self.wandb = wandb
        id_path = os.path.join(dump_folder, self.ID_FILE)
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]  # W&B run ids: lower-case letters and digits
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        self.run = wandb.init(
            project=settings.project, entity=settings.entity or None,
            name=settings.run_name or os.path.basename(os.path.abspath(dump_folder)),
            group=settings.group or None, tags=list(settings.tags) or None, mode=settings.mode, dir=dump_folder,
            id=run_id, resume="allow", config=config, settings=wandb.Settings(silent=True),
        )

    @property
    def run_id(self) -> str:
        return self.run.id

    def write(self, step: int, scalars: dict[str, float], series: dict[str, list[float]]) -> None:
        payload: dict[str, Any] = dict(scalars)
        payload.update({key: self.wandb.Histogram(values) for key, values in series.items()})
        self.run.log(payload, step=step)

    def close(self) -> None:
        self.run.finish()
