"""A sandbox for model-written Python: the ReTool interpreter and the coding agent's test runner.

    Sandbox(limits).run(code, stdin="") -> SandboxResult      blocking; safe to call from many threads

Code a model wrote is hostile. Its boundary is the kernel's, set up by bubblewrap (``reflow.envs.isolation``:
namespaces, an unprivileged user, a read-only view of only the interpreter, size-limited tmpfs mounts) with a
seccomp filter as a second layer (``reflow.envs.seccomp``), and, where the host lets this process make them, a
cgroup per run that bounds the run's total memory and processes (``reflow.envs.cgroups``; elsewhere those
bounds are per process). Inside, the launcher (``reflow.envs.sandbox_child``)
sets the resource limits before the code runs and installs an audit hook, a third layer that only words
refusals for the model: nothing depends on it, and the battery in ``tests/envs`` runs with it off.

Fail closed: where the kernel boundary cannot be set up, ``Sandbox()`` raises ``SandboxUnavailable`` (one
line: what is missing and how to install it), unless ``allow_unisolated`` (``task.sandbox_allow_unisolated``)
says to run the code anyway, which is logged as a warning on every sandbox built.

What the parent does, so that it survives any child (``reflow.envs.supervisor`` tells a run's life, who
waits for whom, and why it cannot block):
  1. the code, the launcher and the seccomp program go to bwrap through memory file descriptors, stdin is a
     read-only one: no file on the host that the child could replace, and no write that could block
  2. stdout and stderr come back through pipes, read here with a deadline (``wall_s``) and a cap on the total
     (``output_cap_bytes``): past either, the whole run is killed
  3. the status comes from the wait status, never from text the child printed: bwrap exits with the
     program's exit code, or 128 + N when a signal N killed it (a SIGKILL the parent did not send: the CPU
     limit); the launcher's exit code for an uncaught MemoryError is ``EXIT_MEMORY`` (a child faking one only
     mislabels its own failure); the run's cgroup, where there is one, counts its OOM kills
  4. every run ends with SIGKILL to the sandbox's init through a process descriptor, which ends its whole PID
     namespace; cleanup never raises and never blocks past a short grace; a run that cannot even start is
     status ``sandbox_error``, and its sample scores 0 like any failure, while the rollout worker goes on

Statuses: ok, error (exit code != 0), timeout (wall clock), cpu_limit, memory_limit, output_limit, killed (any
other signal), sandbox_error (the run could not be started).
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import sys
import time
from dataclasses import dataclass

from reflow.envs.cgroups import detect
from reflow.envs.isolation import INSTALL_HINT, USERNS_HINT, KernelBoundary, SandboxUnavailable
from reflow.envs.supervisor import RunProcess

logger = logging.getLogger("reflow")

class NoCgroup(SandboxUnavailable):
    """The kernel boundary holds, but no per-run cgroup can be made here."""


NO_CGROUP = (
    "this process can make no per-run cgroup (a writable cgroup v1 memory and pids hierarchy, or a delegated "
    "cgroup v2 subtree with both controllers: run the worker as root, or under systemd-run --user --scope -p "
    "Delegate=yes, or Slurm with cgroup delegation). Without one a run's kernel memory has no bound: tmpfs "
    "inodes (the size bound counts bytes), unread pipe and socket buffers, page tables; only each process's "
    "address space, file size, open files and the run's process count are bounded. "
    "task.sandbox_allow_without_cgroup = true runs model code with those bounds only"
)
"""Why a run needs a cgroup by default (``task.sandbox_allow_without_cgroup`` opts out)."""

EXIT_MEMORY = 247
"""The launcher's exit code for a MemoryError the code did not catch (``sandbox_child``)."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock seconds before the whole run is killed (a sleeping or blocked program, or one that will not
    close its output)."""
    cpu_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU): the kernel stops an endless loop with SIGKILL."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS): a larger allocation raises MemoryError."""
    file_size_mb: int = 8
    """Largest file the program may write (RLIMIT_FSIZE)."""
    disk_mb: int = 32
    """Size of each writable tmpfs, the working directory and /tmp (their pages are memory)."""
    shm_mb: int = 8
    """Size of /dev/shm (POSIX shared memory and semaphores)."""
    output_bytes: int = 4096
    """Bytes of stdout and of stderr kept for the result (the rest is cut, and the result says so)."""
    output_cap_bytes: int = 1 << 20
    """Bytes of stdout and stderr together the parent reads before it kills the run (status output_limit)."""
    processes: int = 16
    """Processes of the run: its cgroup's pids.max where there is one, and RLIMIT_NPROC (counted in the run's
    own user namespace). Without a cgroup a run's memory is bounded by processes x memory_mb."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """(soft, hard) per resource limit, which the launcher sets before the code runs: hard and soft alike (an
        unprivileged process cannot raise a hard limit again). At the CPU limit the kernel sends SIGKILL (the
        launcher is its namespace's init, which ignores a SIGXCPU)."""
        cpu_s = max(1, int(self.cpu_s))
        return {
            "RLIMIT_CORE": (0, 0), "RLIMIT_CPU": (cpu_s, cpu_s),
            "RLIMIT_AS": (self.memory_mb << 20,) * 2, "RLIMIT_FSIZE": (self.file_size_mb << 20,) * 2,
            "RLIMIT_NOFILE": (self.open_files,) * 2, "RLIMIT_NPROC": (self.processes,) * 2, "RLIMIT_MSGQUEUE": (0, 0),
            # every other limit a worker may pass on, pinned: no real-time priority or time, no lower nice value,
            # 64 KiB of locked memory (the kernel's default), 64 queued signals (each is kernel memory)
            "RLIMIT_RTPRIO": (0, 0), "RLIMIT_RTTIME": (0, 0), "RLIMIT_NICE": (0, 0),
            "RLIMIT_MEMLOCK": (64 << 10,) * 2, "RLIMIT_SIGPENDING": (64, 64),
        }


@dataclass
class SandboxResult:
    status: str
    """ok | error | timeout | cpu_limit | memory_limit | output_limit | killed | sandbox_error (module docstring)."""
    stdout: str
    stderr: str
    exit_code: int | None
    """The exit code bwrap reported (128 + N: the program died of signal N), None if never reaped."""
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
            "sandbox_error": "the sandbox could not run the program",
        }.get(self.status)
        lines = self.stderr.strip().splitlines()
        tail = "\n".join(lines[-3:])[-limit:]
        return (out + ("\n" if out and not out.endswith("\n") else "") + (reason or tail)).strip()


class Sandbox:
    def __init__(
        self, limits: SandboxLimits | None = None, allow_unisolated: bool = False, python: str = "",
        boundary: KernelBoundary | None = None, audit_hook: bool = True, kernel: bool = True,
        allow_without_cgroup: bool = False, cgroups: bool = True,
    ):
        """``python``: the interpreter to run the code with ("": chosen by ``isolation.choose_interpreter``);
        ``boundary``: a checked one (else ``checked_boundary``); ``audit_hook``: the third layer;
        ``kernel=False`` (with ``allow_unisolated``): no kernel boundary even where the host has one (the
        benchmark's comparison); ``allow_without_cgroup`` (``task.sandbox_allow_without_cgroup``): run where no
        per-run cgroup can be made, with the per-process bounds only (``NO_CGROUP``); ``cgroups=False``: make
        none even where the host allows it (the battery's second pass)."""
        self.limits = limits or SandboxLimits()
        self.audit_hook = audit_hook
        self.boundary = boundary
        if not kernel:
            if not allow_unisolated:
                raise ValueError("Sandbox(kernel=False) runs code without the kernel boundary: it needs allow_unisolated=True")
            self.boundary = None
            _warn_unisolated("asked for (kernel=False)")
        elif self.boundary is None:
            try:
                self.boundary = checked_boundary(python)
            except SandboxUnavailable as error:
                if not allow_unisolated:
                    raise
                _warn_unisolated(str(error))
        self.python = self.boundary.interpreter.executable if self.boundary is not None else (python or sys.executable)
        self.cgroups = detect() if self.boundary is not None and cgroups else None
        """Where per-run cgroups are made (``reflow.envs.cgroups``), or None: the bounds are per process."""
        if self.boundary is not None and self.cgroups is None and not allow_without_cgroup:
            raise NoCgroup(NO_CGROUP)

    @property
    def isolation(self) -> list[str]:
        """The layers in force (module docstring)."""
        kernel = ["namespaces", "unprivileged user", "read-only root", "seccomp"] if self.boundary is not None else []
        cgroup = [f"cgroup v{self.cgroups.version} (memory and processes per run)"] if self.cgroups is not None else []
        return kernel + cgroup + ["limits", "cleared environment"] + (["audit hook"] if self.audit_hook else [])

    def _launcher_args(self) -> list[str]:
        """``sandbox_child.main``'s arguments: the audit hook (1 or 0), the exit code for a MemoryError, then one
        ``RLIMIT_X=soft,hard`` per limit (plain words: the launcher imports no parser, a run starts sooner)."""
        limits = [f"{name}={soft},{hard}" for name, (soft, hard) in self.limits.rlimits().items()]
        return [str(int(self.audit_hook)), str(EXIT_MEMORY), *limits]

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` (its stdin: ``stdin``) to its end or a limit; nothing the code does makes this raise
        (``reflow.envs.supervisor`` tells the run's life)."""
        t0 = time.perf_counter()
        try:
            if self.boundary is not None:
                run = RunProcess.start_kernel(self.boundary, self.limits, code, stdin, self._launcher_args(), self.cgroups)
            else:
                run = RunProcess.start_unisolated(self.python, code, stdin, self._launcher_args())
        except Exception as error:  # noqa: BLE001 - a run that cannot start scores 0; the worker goes on
            logger.warning(f"sandbox: could not start a run: {error!r}")
            return SandboxResult("sandbox_error", "", f"sandbox: {error}", None, time.perf_counter() - t0)
        try:
            outcome = run.supervise(self.limits, t0)
        except Exception as error:  # noqa: BLE001
            logger.warning(f"sandbox: supervising a run failed: {error!r}")
            return SandboxResult("sandbox_error", "", f"sandbox: {error}", None, time.perf_counter() - t0)
        finally:
            run.end()
        status = outcome.verdict or _status(outcome.exit_code)
        return SandboxResult(status, outcome.stdout, outcome.stderr, outcome.exit_code, time.perf_counter() - t0,
                             outcome.truncated)


@functools.lru_cache(maxsize=4)
def checked_boundary(python: str = "") -> KernelBoundary:
    """The boundary this host allows (``KernelBoundary.for_host``), proven by one run of ``print('ok')`` with no
    limits but the boundary's (once per process and interpreter); fails with the reason and a hint."""
    boundary = KernelBoundary.for_host(python)
    result = Sandbox(SandboxLimits(wall_s=60.0, cpu_s=30.0), boundary=boundary, audit_hook=False,
                     allow_without_cgroup=True, cgroups=False).run("print('ok')")
    if result.status == "ok" and result.stdout == "ok\n":
        return boundary
    said = (result.stderr.strip().splitlines() or [result.status])[-1]
    hint = USERNS_HINT if re.search(r"namespace|uid map|Operation not permitted|Permission denied", said) else INSTALL_HINT
    raise SandboxUnavailable(f"bubblewrap could not start a sandbox here (bwrap: {said}): {hint}")


def _warn_unisolated(why: str) -> None:
    logger.warning(
        f"SANDBOX WITHOUT KERNEL ISOLATION: {why}. task.sandbox_allow_unisolated = true: model-written code runs "
        "as this user with resource limits and an audit hook only, which hostile code can get past"
    )


def _status(exit_code: int | None) -> str:
    """From the wait status: bwrap exits with 128 + N when the program died of signal N (without the kernel
    boundary, the launcher's own wait status says the same as -N); unknown (reaped by the kernel) is error.
    A SIGKILL the parent did not send (its own kills are verdicts) and that the run's cgroup does not count as
    an OOM kill (a verdict too) is the CPU limit's: the program's own signals to itself, as its namespace's
    init, are ignored by the kernel."""
    if exit_code == 0:
        return "ok"
    if exit_code in (128 + signal.SIGKILL, -signal.SIGKILL, 128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "cpu_limit"
    if exit_code == EXIT_MEMORY:
        return "memory_limit"
    if exit_code is not None and (exit_code > 128 or exit_code < 0):
        return "killed"
    return "error"


__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "EXIT_MEMORY"]
