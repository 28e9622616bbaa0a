"""Checkpoint writes are atomic and pruned: a write killed after its data and before its metadata leaves the
previous checkpoint the latest and loadable; the next save at that step clears the leftover; keep_last keeps
only the newest."""

import json
import os
import signal
import subprocess
import sys

from tests.conftest import ROOT, free_port

SCRIPT = os.path.join(ROOT, "tests", "trainer", "scripts", "checkpoint_write.py")


def script(*args: str, stall: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PORT=str(free_port()), PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args, *(["--stall"] if stall else [])], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return out


def loaded(folder: str) -> dict:
    return json.loads(finished(script("load", folder)).strip().splitlines()[-1])


def test_a_killed_write_leaves_the_previous_checkpoint_and_keep_last_prunes(tmp_path):
    folder = str(tmp_path)
    finished(script("save", folder, "1", "1.0", "2"))
    # step 2: killed with its data written and its metadata not
    proc = script("save", folder, "2", "2.0", "2", stall=True)
    assert proc.stdout.readline().strip() == "stalled"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    partial = os.path.join(folder, "checkpoint", "step-2.partial")
    assert os.path.isdir(partial) and os.listdir(partial)  # the leftover is there, data and all
    assert loaded(folder) == {"steps": [1], "value": [1.0], "step": 1}  # a resume takes step 1, intact
    # the next save at step 2 replaces the leftover; then step 3 and 4 with keep_last = 2
    finished(script("save", folder, "2", "2.0", "2"))
    assert not os.path.exists(partial)
    assert loaded(folder) == {"steps": [1, 2], "value": [2.0], "step": 2}
    finished(script("save", folder, "3", "3.0", "2"))
    finished(script("save", folder, "4", "4.0", "2"))
    assert loaded(folder) == {"steps": [3, 4], "value": [4.0], "step": 4}
    assert sorted(os.listdir(os.path.join(folder, "checkpoint"))) == ["step-3", "step-4"]
