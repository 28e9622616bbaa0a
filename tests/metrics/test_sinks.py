"""The metric sinks: lists become histograms (counts expanded to values), and Weights & Biases, run with the real
library offline, gets the run's scalars and histograms and continues the same run on resume."""

import glob
import os
import time

import pytest

from reflow.metrics.logger import MetricsLogger
from reflow.metrics.sinks import WandbSettings, split_row


def _records(run_dir: str, last: bytes, wait_s: float = 30.0) -> bytes:
    """The offline run's record file once ``last`` is in it: W&B's service may still be writing it after
    ``finish`` returned."""
    path = glob.glob(os.path.join(run_dir, "run-*.wandb"))[0]
    deadline = time.time() + wait_s
    while True:
        data = open(path, "rb").read()
        if last in data or time.time() > deadline:
            return data
        time.sleep(0.1)


def test_a_row_splits_into_scalars_and_histograms():
    scalars, series = split_row({
        "loss": 0.5, "mode": "reflow", "skipped": True, "nan": float("nan"),
        "staleness_counts": [2, 0, 1], "survival_by_length_decile": [1.0, 0.9], "empty": [],
    })
    assert scalars == {"loss": 0.5}
    assert series == {"staleness_counts": [0.0, 0.0, 2.0], "survival_by_length_decile": [1.0, 0.9]}


def test_wandb_offline_gets_every_row_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = WandbSettings(project="reflow-test", group="seeds", tags=("cpu",), mode="offline")
    row = {"loss": 0.25, "reward_mean": 0.75, "staleness_counts": [3, 1]}
    first = MetricsLogger(str(tmp_path), True, 4, tensorboard=True, progress=False, wandb=settings, config={"job": {"seed": 0}})
    first_id = first.sinks[1].run_id
    first.log(1, row)
    first.close()
    # wandb names an offline segment by its start second and the run id: a resume within the same second (a
    # test, never a restarted job) would write into the first segment's folder
    second = int(time.time())
    while int(time.time()) == second:
        time.sleep(0.05)
    resumed = MetricsLogger(str(tmp_path), True, 4, tensorboard=False, progress=False, wandb=settings, config={})
    assert resumed.sinks[0].run_id == first_id  # the id kept in <dump_folder>/wandb_run_id
    resumed.log(2, {"loss": 0.125})
    resumed.close()
    runs = sorted(glob.glob(os.path.join(tmp_path, "wandb", f"offline-run-*-{first_id}")))
    assert len(runs) == 2  # one offline segment per process, the same run id: ``wandb sync`` joins them
    # the records hold the keys and their values (protobuf keeps strings and JSON values as plain bytes)
    logged = _records(runs[0], b"seeds")
    for needle in (b"loss", b"0.25", b"reward_mean", b"staleness_counts", b"histogram", b"seeds"):
        assert needle in logged, needle
    assert b"0.125" in _records(runs[1], b"0.125")
    assert glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents*"))
