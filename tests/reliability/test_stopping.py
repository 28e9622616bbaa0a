"""Stopping early, the way a cluster stops a run: a SIGTERM (Slurm's preemption) or SIGUSR1 (its warning) to
the ranks stops every rank after the current step with a checkpoint and exit code 0, and the same command
resumes; NaN in the loss skips the update, and a streak of them stops the run with one clear error."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from reflow.stopping import NonFiniteGuard, StopSignals
from tests.conftest import ROOT, free_port

ENV = dict(
    os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
    OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
)


def torchrun(nproc: int, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           *args]
    return subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(extra_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def train_args(dump: str, *extra: str) -> list[str]:
    return [
        "-m", "reflow.train", "--config", "train_configs/tiny.toml", f"--job.dump_folder={dump}",
        "--training.prompts_per_step=4", "--training.group_size=4", "--rollout.max_new_tokens=16",
        "--metrics.enable_progress_bar=false", "--checkpoint.export_hf=false", *extra,
    ]


def rows(dump: str) -> list[dict]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def workers(agent_pid: int) -> dict[int, int]:
    """The agent's rank processes, by global rank."""
    out = subprocess.run(["pgrep", "-P", str(agent_pid)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, out):
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        ranks[int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])] = pid
    return ranks


@pytest.mark.parametrize(
    "mode,nproc,extra,sig,signalled",
    [
        ("sync", 2, [], signal.SIGTERM, "every rank"),
        # Slurm's signal reaches the torchrun agents one by one: here only trainer rank 1 has it when the step
        # ends, and rank 0, which writes the stop record the Slurm script requeues on, must still name SIGUSR1
        ("reflow", 3, ["--placement.num_rollout_ranks=1", "--replay.sigma=0.5", "--replay.delta=2"], signal.SIGUSR1,
         "rank 1"),
    ],
    ids=["sync-sigterm", "reflow-sigusr1-one-rank"],
)
def test_a_stop_signal_checkpoints_exits_zero_and_the_run_resumes(tmp_path, mode, nproc, extra, sig, signalled):
    dump = str(tmp_path / mode)
    args = train_args(dump, f"--training.mode={mode}", "--training.steps=200", "--checkpoint.enable=true",
                      "--checkpoint.interval=1000", *extra)
    run = torchrun(nproc, args)
    deadline = time.time() + 300
    while len([r for r in rows(dump) if "loss" in r]) < 2:  # training is under way
        assert run.poll() is None and time.time() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.5)
    ranks = workers(run.pid)
    assert sorted(ranks) == list(range(nproc)), ranks
    for rank, pid in ranks.items():  # as Slurm does: every process of the job step gets the signal, in turn
        if signalled == "every rank" or rank == 1:
            os.kill(pid, sig)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-4000:]
    trained = [r["step"] for r in rows(dump) if "loss" in r]
    stopped_at = trained[-1]
    assert stopped_at < 200
    assert f"stopped by {sig.name} after step {stopped_at}" in out + err
    assert f"trained {stopped_at} of 200 steps" in out + err
    assert os.path.isdir(os.path.join(dump, "checkpoint", f"step-{stopped_at}"))
    assert json.load(open(os.path.join(dump, "stopped.json")))["by"] == sig.name  # rank 0's record: requeue or not
    # the same command, with room for two more steps, resumes there
    resumed = torchrun(nproc, [*args, f"--training.steps={stopped_at + 2}"])
    out, err = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, err[-4000:]
    assert f"resumed from step {stopped_at}" in out + err
    assert [r["step"] for r in rows(dump) if "loss" in r][-2:] == [stopped_at + 1, stopped_at + 2]


def test_nonfinite_updates_are_skipped_and_a_streak_stops_the_run(tmp_path):
    dump = str(tmp_path / "nan")
    script = os.path.join(ROOT, "tests", "reliability", "scripts", "train_with_nonfinite.py")
    run = torchrun(2, [script, *train_args(
        dump, "--training.steps=20", "--training.max_nonfinite_steps=3", "--checkpoint.enable=true",
        "--checkpoint.interval=1", "--checkpoint.keep_last=0",
    )[2:]], {"REFLOW_TEST_NAN_FROM": "4"})
    out, err = run.communicate(timeout=400)
    assert run.returncode != 0
    trained = {r["step"]: r for r in rows(dump) if "loss" in r}
    assert sorted(trained) == [1, 2, 3, 4, 5, 6]  # three steps in a row skipped (4, 5, 6): stop there
    assert [trained[s]["skipped_updates"] for s in range(1, 7)] == [0, 0, 0, 1, 1, 1]
    # a skipped update keeps the last good state: the checkpoints after steps 3, 4 and 5 hold the same model and
    # AdamW state, bitwise; the streak's last step saves none
    states = {step: _checkpoint_tensors(os.path.join(dump, "checkpoint", f"step-{step}"), tmp_path) for step in (3, 4, 5)}
    assert not os.path.exists(os.path.join(dump, "checkpoint", "step-6"))
    assert states[3].keys() == states[5].keys() and len(states[3]) > 40
    assert all(torch.equal(states[3][k], states[n][k]) for n in (4, 5) for k in states[3])
    lines = [line for line in err.splitlines() if line.startswith("reflow: training stopped")]
    assert lines == [
        "reflow: training stopped after step 6: training.max_nonfinite_steps = 3: steps 4..6 each had a non-finite "
        "loss or gradient (their updates were skipped); stopping. Lower training.lr, check the rewards for NaN, "
        "or resume from an earlier checkpoint"
    ]


def _checkpoint_tensors(folder: str, tmp_path) -> dict:
    """A DCP checkpoint's tensors (model and optimizer), read in this process without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / (os.path.basename(folder) + ".pt"))
    dcp_to_torch_save(folder, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False)["trainer"])
    return flat


def test_a_cancel_outranks_the_time_limit_warning_across_ranks():
    """The all-reduce takes the MAX of the ranks' codes: SIGTERM (cancel, preemption) wins over SIGUSR1 (which
    requeues), so a job being cancelled never requeues itself; no signal is code 0."""
    warned, cancelled, quiet = StopSignals(), StopSignals(), StopSignals()
    warned._record(signal.SIGUSR1, None)
    cancelled._record(signal.SIGTERM, None)
    assert quiet.code == 0 and StopSignals.name_of(0) is None
    assert StopSignals.name_of(max(warned.code, quiet.code)) == "SIGUSR1"
    assert StopSignals.name_of(max(warned.code, cancelled.code, quiet.code)) == "SIGTERM"
    cancelled._record(signal.SIGUSR1, None)  # a rank keeps its highest-precedence signal
    assert cancelled.received == "SIGTERM"
    warned._record(signal.SIGTERM, None)  # a cancel after the warning is a cancel
    assert warned.received == "SIGTERM"


def test_the_guard_counts_only_steps_in_a_row():
    guard = NonFiniteGuard(limit=2)
    assert [guard.observe(step, skipped) is None for step, skipped in enumerate([1, 0, 1, 0, 1, 1], 1)] == [
        True, True, True, True, True, False,
    ]
    assert NonFiniteGuard(limit=0).observe(1, 1) is None  # 0: never stop
