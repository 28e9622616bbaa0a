"""``reflow``, the launcher: torchrun's flags and reflow's arguments apart wherever they are given, and bad input
as one line with exit code 2 before torchrun starts a rank."""

import os
import subprocess
import sys

from reflow.cli import main, split_arguments
from tests.conftest import ROOT


def test_torchrun_flags_are_told_apart_from_reflow_arguments_wherever_they_stand():
    torchrun, train = split_arguments([
        "--config", "train_configs/tiny.toml", "--nproc-per-node", "2", "--training.lr=1e-4",
        "--max-restarts=1", "--nnodes", "1", "--training.steps", "3",
    ])
    assert torchrun == ["--nproc-per-node", "2", "--max-restarts=1", "--nnodes", "1"]
    assert train == ["--config", "train_configs/tiny.toml", "--training.lr=1e-4", "--training.steps", "3"]


def test_a_config_error_is_one_line_and_exit_2_before_any_rank(tmp_path, capsys):
    code = main(["train", "--nproc-per-node", "2", "--config", "train_configs/tiny.toml", "--training.group_size=0",
                 f"--job.dump_folder={tmp_path}/run"])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and "training.group_size" in lines[0]
    # the placement against the world the launcher would start: 3 ranks cannot hold tiny_elastic's 4
    code = main(["train", "--nproc-per-node", "3", "--config", "train_configs/tiny_elastic.toml",
                 f"--job.dump_folder={tmp_path}/run"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "WARNING" not in line]
    assert code == 2 and len(lines) == 1 and "placement" in lines[0]


def test_the_console_script_runs_in_a_clean_shell():
    """The installed ``reflow`` command (the project's interpreter, whatever PATH holds) answers --help."""
    script = os.path.join(os.path.dirname(sys.executable), "reflow")
    if not os.path.exists(script):  # installed before the entry point existed: make reinstalls on setup.py
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT], check=True, timeout=600)
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "reflow train" in proc.stdout
