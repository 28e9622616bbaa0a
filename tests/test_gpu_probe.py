"""The device probe (scripts/gpu_probe.py) is ready before a device is lent: on a machine without CUDA every stage
reports SKIP with the reason and the JSON is complete; the torch-only stages' code runs on the CPU at small
shapes (--cpu-selftest: figures meaningless, code paths proven), parking round trips bitwise into buffers of the
exact requested size."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


def _probe(tmp_path, *args: str) -> dict:
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_probe.py", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    return {"rc": proc.returncode, **report}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the probe would run for real")
def test_without_cuda_every_stage_is_skipped_with_its_reason(tmp_path):
    rep = _probe(tmp_path)
    assert rep["rc"] == 0
    assert list(rep["stages"]) == ["environment", "nccl", "logprobs", "pinned", "block", "fsdp"]
    assert all(stage["status"] == "SKIP" and "CUDA" in stage["reason"] for stage in rep["stages"].values())


def test_the_torch_only_stages_run_their_code_on_the_cpu(tmp_path):
    rep = _probe(tmp_path, "--cpu-selftest", "--stages", "environment,nccl,logprobs,pinned")
    assert rep["rc"] == 0, rep
    stages = rep["stages"]
    assert all(stage["status"] == "PASS" for stage in stages.values()), stages
    assert stages["nccl"]["all_reduce_ok"] and stages["logprobs"]["finite"]
    pinned = stages["pinned"]
    assert pinned["bitwise_back"] and pinned["host_bytes_equal_requested"] and pinned["exact_setting_applied"]


def test_an_unknown_stage_is_refused_by_name(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_probe.py", "--out", str(tmp_path / "p.json"), "--stages", "pinnd"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "pinnd" in proc.stderr
