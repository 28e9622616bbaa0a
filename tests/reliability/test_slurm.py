"""The Slurm launch as shipped: ``python -m reflow.slurm`` renders a batch script whose nodes and tasks follow the
config, and a real Slurm (Debian's slurm-wlm and munge, a one-node cluster started here) runs it: the tiny
workload as a 2-task job, two torchrun agents joined by torchrun's c10d rendezvous, trains and exports.

The daemons are installed when absent and apt is usable (as root, as in CI), started with a configuration in a
temporary folder, and stopped by their PIDs at the end. Skipped, with the reason, where that cannot be done."""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from reflow.slurm import job_shape
from tests.conftest import ROOT


def test_job_shape_follows_the_placement():
    assert job_shape(8, 8, 8, 1).__dict__ == dict(world_size=8, nodes=1, tasks_per_node=1, ranks_per_task=8, gpus_per_node=8)
    shape = job_shape(32, 8, 8, 1)  # the 32B recipe's placement
    assert (shape.nodes, shape.agents, shape.ranks_per_task) == (4, 4, 8)
    with pytest.raises(ValueError, match="do not split into torchrun agents of 8 ranks"):
        job_shape(12, 8, 8, 1)
    shape = job_shape(2, 0, 2, 2)  # the test's CPU job: one node, two agents of one rank
    assert (shape.nodes, shape.tasks_per_node, shape.agents, shape.ranks_per_task) == (1, 2, 2, 1)


def test_the_shipped_configs_render(tmp_path):
    for config, nodes in (("qwen3_8b", 1), ("qwen3_32b", 4)):
        out = tmp_path / f"{config}.sbatch"
        run = subprocess.run(
            [sys.executable, "-m", "reflow.slurm", "--config", f"train_configs/{config}.toml", "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, run.stderr
        text = out.read_text()
        assert f"#SBATCH --nodes={nodes}" in text and f"--nnodes {nodes} --nproc-per-node 8" in text
        assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text and "--check" in text
        assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "reflow.run_record stopped" in text
        # host memory from the plan: the node's pinned buffers plus each rank's own
        from reflow.config import ConfigManager
        from reflow.config.validate import validate_world
        from reflow.memory_plan import memory_plan
        from reflow.model.recipe import load_recipe
        from reflow.slurm import HOST_GIB_PER_RANK

        cfg = ConfigManager().parse_args(["--config", f"train_configs/{config}.toml"])
        plan = memory_plan(cfg, load_recipe(cfg.model.recipe), validate_world(cfg, 8 * nodes))
        pinned = max(role.pinned_host_bytes for role in plan.roles) * 8 / 2**30
        assert f"#SBATCH --mem={math.ceil(pinned + 8 * HOST_GIB_PER_RANK)}G" in text
    run = subprocess.run(
        [sys.executable, "-m", "reflow.slurm", "--config", "train_configs/tiny.toml"], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )
    assert run.returncode == 2 and "pass --world-size" in run.stderr


# ---------------------------------------------------------------- a real one-node Slurm


def _installed() -> str | None:
    """None when slurmctld, slurmd, sbatch and munged are there (installing them if needed), else why not."""
    tools = ("slurmctld", "slurmd", "sbatch", "munged")
    if all(shutil.which(t) or os.path.exists(f"/usr/sbin/{t}") for t in tools):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm and munge are not installed, and apt-get as root is not available to install them"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"], env=env, capture_output=True,
        text=True, timeout=900,
    )
    if run.returncode != 0:
        update = subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=600)
        run = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"], env=env, capture_output=True,
            text=True, timeout=900,
        )
        if run.returncode != 0:
            return f"apt-get install slurm-wlm munge failed: {(update.stderr + run.stderr)[-500:]}"
    return None


def _pid(path: str) -> int | None:
    try:
        return int(open(path).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def slurm(tmp_path):
    reason = _installed()
    if reason:
        print(f"skipping the real-Slurm test: {reason}")
        pytest.skip(reason)
    host = socket.gethostname().split(".")[0]
    started: list[int] = []
    key = "/etc/munge/munge.key"
    if not os.path.exists(key):
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        os.chmod(key, 0o400)
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, timeout=30)
        started += [int(p) for p in subprocess.run(["pgrep", "-x", "munged"], capture_output=True, text=True).stdout.split()]
    state = tmp_path / "slurm"
    for sub in ("state", "spool", "log"):
        (state / sub).mkdir(parents=True)
    conf = state / "slurm.conf"
    conf.write_text(
        f"ClusterName=reflowtest\nSlurmctldHost={host}\nAuthType=auth/munge\nProctrackType=proctrack/linuxproc\n"
        f"TaskPlugin=task/none\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nSlurmUser=root\n"
        f"StateSaveLocation={state / 'state'}\nSlurmdSpoolDir={state / 'spool'}\n"
        f"SlurmctldPidFile={state / 'slurmctld.pid'}\nSlurmdPidFile={state / 'slurmd.pid'}\n"
        f"SlurmctldLogFile={state / 'log' / 'slurmctld.log'}\nSlurmdLogFile={state / 'log' / 'slurmd.log'}\n"
        f"ReturnToService=2\nMpiDefault=none\n"
        # a requeued job waits cred_expire seconds before it may start again (120 by default: most of the test's
        # time); one node, nothing paged out, so a credential needs far less
        f"AuthInfo=cred_expire=20\n"
        f"NodeName={host} CPUs={os.cpu_count()} RealMemory=4000 State=UNKNOWN\n"
        f"PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP\n"
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    subprocess.run(["/usr/sbin/slurmctld", "-f", str(conf)], env=env, check=True, timeout=60)
    subprocess.run(["/usr/sbin/slurmd", "-f", str(conf)], env=env, check=True, timeout=60)
    deadline = time.time() + 90
    try:
        while True:
            for pidfile in ("slurmctld.pid", "slurmd.pid"):
                pid = _pid(str(state / pidfile))
                if pid and pid not in started:
                    started.append(pid)
            states = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.split()
            if states and all(s == "idle" for s in states):
                break
            assert time.time() < deadline, (f"the node never became idle: {states}; "
                                            f"{(state / 'log' / 'slurmd.log').read_text()[-2000:]}")
            time.sleep(1)
        yield env
    finally:
        # a failed test leaves its job running: cancel it, so its ranks do not outlive the daemons and hold the
        # rendezvous port the next run's job needs
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30).stdout.split()
        if jobs:
            subprocess.run(["scancel", "--full", *jobs], env=env, capture_output=True, timeout=30)
            for _ in range(60):
                if not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout.strip():
                    break
                time.sleep(1)
        for pid in reversed(started):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        # and whatever daemon of this test's config is left (a slurmd whose pid file came after the node went
        # idle outlived a passing run and held the port, so the next run's job never started): each was started
        # with -f and this test's own config path
        subprocess.run(["pkill", "-TERM", "-f", str(conf)], capture_output=True, timeout=30)


def _job_state(job: str, env: dict) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((word.split("=", 1)[1] for word in shown.split() if word.startswith("JobState=")), "")


def test_the_rendered_job_trains_stops_at_the_time_limit_requeues_and_resumes_on_a_real_slurm(tmp_path, slurm):
    """The rendered script on a real one-node Slurm: two torchrun agents join one world and train. Slurm's
    time-limit warning (SIGUSR1, sent here with scancel while the ranks load their engines) stops the ranks after
    their first step's checkpoint; torchrun exits 1 after forwarding it, yet the script ends 0 and requeues the
    job, which resumes from that checkpoint and finishes the run.

    The signal comes at a fixed point, not after some step: once rank 0 logs the world (after the process group
    formed, so every rank has its handler, ``reflow.train`` installs it before that), the ranks still spend
    tens of seconds building their vLLM engines, so the stop is after step 1 on every run. (Sent after step 1,
    it raced the run's end: a fast run finished all 5 steps before the signal reached it, and the job failed.)"""
    dump = tmp_path / "run"
    out = tmp_path / "tiny.sbatch"
    render = subprocess.run(
        [
            sys.executable, "-m", "reflow.slurm", "--config", "train_configs/tiny.toml", "--world-size", "2",
            "--gpus-per-node", "0", "--tasks-per-node", "2", "--cpus-per-task", "1", "--out", str(out),
            # torchrun's --shutdown-timeout follows: 290 s for the ranks to build, train a step and checkpoint
            "--signal-s", "300",
            f"--job.dump_folder={dump}", "--training.steps=5", "--training.prompts_per_step=4", "--training.group_size=4",
            "--rollout.max_new_tokens=16", "--metrics.enable_progress_bar=false", "--checkpoint.enable=true",
            "--checkpoint.interval=1",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert render.returncode == 0, render.stderr
    text = out.read_text()
    assert "--mem" not in text  # a CPU cluster: the plan does not size host memory
    assert os.path.isdir(dump / "slurm")  # Slurm opens the log there before the script runs
    submit = subprocess.run(["sbatch", "--parsable", str(out)], cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]

    def log() -> str:
        logs = [p for p in (dump / "slurm").iterdir() if p.suffix == ".out"]
        return logs[0].read_text() if logs else ""

    def wait_for(condition, what: str, seconds: float) -> None:
        deadline = time.time() + seconds
        while not condition():
            assert time.time() < deadline, f"{what} never happened; job {_job_state(job, slurm)}:\n{log()[-4000:]}"
            time.sleep(1)

    metrics = dump / "metrics.jsonl"
    wait_for(lambda: "[reflow] world 2:" in log(), "the process group", 400)
    assert '"loss"' not in metrics.read_text()  # still loading: no step has run
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True, timeout=60)  # the time limit's warning
    wait_for(lambda: "requeueing job" in log(), "the requeue", 400)
    stop = json.loads((dump / "stopped.json").read_text())
    assert stop == dict(stop, by="SIGUSR1", step=1, checkpoint=True), stop
    assert "stopped by SIGUSR1 after step 1" in log()
    wait_for(lambda: _job_state(job, slurm) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", ""), "the job's end", 600)
    assert _job_state(job, slurm) == "COMPLETED", log()[-4000:]
    assert f"resumed from step {stop['step']}" in log() and "trained 5 steps" in log()
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]  # each step once, across the requeue
    assert (dump / "hf_final" / "model.safetensors").exists()
    assert "world 2" in log()  # two agents, one rank each, joined one world through the c10d rendezvous
    assert not (dump / "stopped.json").exists()  # the resumed run cleared the stop it resumed from
