"""A sandbox for model-written Python: the ReTool interpreter and the coding agent's test runner.

    Sandbox(limits).run(code, stdin="") -> SandboxResult      blocking; safe to call from many threads

Each run gets a fresh process and a throwaway working directory, and leaves nothing behind. The layers,
outermost first (``isolation`` names the ones this host allows):

  namespaces   ``unshare --net --pid --fork --kill-child`` (with ``--user --map-root-user`` when not root):
               no network devices, its own PID space (the host's processes, the rollout worker among
               them, are invisible), and killing the sandbox's first process kills everything in it
  user         when the host runs as root, the child drops to ``nobody`` before the code runs, where
               ``nobody`` can read this Python installation (one under a private /root cannot be: the
               child then stays root in its namespaces, and the audit hook refuses every new process,
               since the kernel does not apply the process-count limit to root)
  limits       CPU seconds, address space, file size (stdout and stderr are files too, so huge output
               is stopped by it), open files, process count, no core dumps; a wall-clock limit enforced
               here, which kills the whole process group
  environment  a scrubbed environment (PATH, HOME and LANG only: nothing of the host's, no secrets),
               ``python -I`` (no user site, no PYTHON* variables), the working directory as HOME and cwd
  audit hook   no network calls, other programs, ctypes, signals to other processes, or files outside
               the working directory (``reflow.envs.sandbox_child``)

What comes back is a ``SandboxResult``: the status (ok, error, timeout, cpu_limit, memory_limit,
output_limit, refused, killed), the first ``output_bytes`` of stdout and stderr, and ``message()``, the
text a model is shown. Hostile code gets that message (``tests/envs/test_sandbox.py`` runs the battery).

What it is not: a container. There is no mount namespace or seccomp filter, so where the child cannot drop
to ``nobody`` (a Python installation only root can read) the file rules rest on the audit hook alone,
which guards Python's own calls; a native extension already importable could get past it. Run RL on code
from untrusted models on hosts where ``nobody`` can read the Python installation, or inside a container.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
NOBODY = 65534


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed (a sleeping or blocked program)."""
    cpu_s: float = 5.0
    """CPU seconds (RLIMIT_CPU): an endless loop is stopped by SIGXCPU."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS): a larger allocation raises MemoryError."""
    file_size_mb: int = 8
    """Largest file the program may write, stdout and stderr included (RLIMIT_FSIZE)."""
    output_bytes: int = 4096
    """Bytes of stdout and of stderr kept for the result (the rest is cut, and the result says so)."""
    processes: int = 256
    """Processes of the sandbox user, all its runs on the host together (RLIMIT_NPROC counts per user; enforced
    when the child runs as nobody): a bound on a fork bomb, not a per-run quota. Where the child stays
    root, it may start none at all."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""


@dataclass
class SandboxResult:
    status: str
    """ok | error (exit code != 0) | timeout (wall clock) | cpu_limit | memory_limit | output_limit | refused
    (the audit hook said no) | killed (any other signal)."""
    stdout: str
    stderr: str
    exit_code: int | None
    wall_s: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def message(self, limit: int = 1024) -> str:
        """What the model is shown: the output, then the error (its last lines) when there was one."""
        out = self.stdout[:limit]
        if self.status == "ok":
            return out
        reason = {
            "timeout": "time limit exceeded (wall clock)",
            "cpu_limit": "time limit exceeded (CPU)",
            "memory_limit": "memory limit exceeded",
            "output_limit": "output limit exceeded",
            "killed": f"killed (exit {self.exit_code})",
        }.get(self.status)
        lines = self.stderr.strip().splitlines()
        tail = "\n".join(lines[-1:] if self.status == "refused" else lines[-3:])[-limit:]
        return (out + ("\n" if out and not out.endswith("\n") else "") + (reason or tail)).strip()


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """The ``unshare`` command line this host allows (checked once per process), or () when it allows none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    base = [unshare, "--net", "--pid", "--fork", "--kill-child"]
    candidates = [base] if os.geteuid() == 0 else []
    candidates.append([unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"])
    for command in candidates:
        try:
            done = subprocess.run(command + ["true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return tuple(command)
    return ()


@functools.lru_cache(maxsize=1)
def nobody_can_run_python() -> bool:
    """Whether ``nobody`` can start this Python and import from its standard library (checked once)."""
    def become_nobody():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", "import json, sysconfig, collections"], capture_output=True, timeout=30,
            preexec_fn=become_nobody, cwd="/", env={"PATH": "/usr/bin:/bin"},
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


class Sandbox:
    def __init__(self, limits: SandboxLimits | None = None, use_namespaces: bool = True):
        self.limits = limits or SandboxLimits()
        self.prefix = namespace_prefix() if use_namespaces else ()
        self.drop_privileges = os.geteuid() == 0 and nobody_can_run_python()
        self.refuse_processes = os.geteuid() == 0 and not self.drop_privileges

    @property
    def isolation(self) -> list[str]:
        """The layers in force on this host (module docstring)."""
        layers = ["namespaces"] if self.prefix else []
        user = ["user"] if self.drop_privileges else (["no new processes"] if self.refuse_processes else [])
        return layers + user + ["limits", "environment", "audit hook"]

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        limits = self.limits
        workdir = tempfile.mkdtemp(prefix="reflow-sandbox-")
        outdir = tempfile.mkdtemp(prefix="reflow-sandbox-out-")  # the parent's: the code cannot reach it by name
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            with open(os.path.join(workdir, "stdin.txt"), "w", encoding="utf-8") as f:
                f.write(stdin)
            child_limits = asdict(limits) | {"refuse_processes": self.refuse_processes}
            if self.drop_privileges:
                child_limits.update(drop_to_uid=NOBODY, drop_to_gid=NOBODY)
                for name in ("", "main.py", "stdin.txt"):
                    os.chown(os.path.join(workdir, name), NOBODY, NOBODY)
                os.chmod(workdir, 0o700)
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "TMPDIR": workdir}
            command = [*self.prefix, sys.executable, "-I", CHILD, json.dumps(child_limits)]
            stdout_path, stderr_path = os.path.join(outdir, "stdout"), os.path.join(outdir, "stderr")
            t0 = time.perf_counter()
            with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
                process = subprocess.Popen(
                    command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True, close_fds=True,
                )
                timed_out = False
                try:
                    process.wait(timeout=limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(process.pid)
                    process.wait()
            wall_s = time.perf_counter() - t0
            stdout, cut_out = _read_head(stdout_path, limits.output_bytes)
            stderr, cut_err = _read_head(stderr_path, limits.output_bytes)
            status = _status(process.returncode, timed_out, stderr)
            return SandboxResult(status, stdout, stderr, process.returncode, wall_s, cut_out or cut_err)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(outdir, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    """SIGKILL the sandbox's process group: everything it started that kept the group (in a PID namespace,
    killing its first process kills the rest)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_head(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _status(returncode: int | None, timed_out: bool, stderr: str) -> str:
    """The child names the limits it hit on stderr (``sandbox_child``); a signal that killed it outright
    is a negative code, or a nonzero one when ``unshare`` could not pass it on."""
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if "sandbox: CPU time limit exceeded" in stderr:
        return "cpu_limit"
    if "File too large" in stderr or returncode == 120:  # 120: Python could not flush stdout at exit
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory_limit"
    if "PermissionError: sandbox:" in stderr:
        return "refused"
    if returncode is not None and returncode < 0:
        return "killed"
    return "error"
