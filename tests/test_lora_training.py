"""LoRA runs end to end under torchrun (2 ranks, ``train_configs/tiny_lora.toml``), in every mode (reflow's is
the 40-step learning run of ``tests/test_tiny_variants_learn.py``): the weight sync
moves the adapters only (``reflow.weight_sync.adapters``) and adds them to the engines as a new version; the
decoupled modes hold nothing at a sync (every trajectory finishes on the adapter it started on); the run ends
with the merged policy and a peft adapter folder."""

import json
import os

import pytest

from tests.conftest import run_torchrun
from tests.lora_checks import check_lora_run


def _rows(dump: str) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "reward_mean" in r]


@pytest.mark.parametrize("mode", ["async", "one_step_off", "sync"])
def test_lora_trains_with_adapter_syncs(tmp_path, mode):
    """(reflow mode's LoRA run is test_tiny_variants_learn's ``lora`` variant, 40 steps, which checks the same.)"""
    dump = str(tmp_path / mode)
    placement = [] if mode != "sync" else ["--placement.num_rollout_ranks=0", "--placement.trainer_shard_degree=-1"]
    run_torchrun(2, ["-m", "reflow.train", "--config", "train_configs/tiny_lora.toml", f"--job.dump_folder={dump}",
                     f"--training.mode={mode}", "--training.steps=3", "--metrics.eval_interval=0",
                     "--checkpoint.export_hf=true", *placement])
    rows = _rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3]
    check_lora_run(dump, rows, mode)
