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

What the parent does, so that it survives any child:
  1. the code, the launcher and the seccomp program go to bwrap through memory file descriptors, stdin is
     one too: no file on the host that the child could replace, and no write that could block
  2. stdout and stderr come back through pipes, read here with a deadline (``wall_s``) and a cap on the total
     (``output_cap_bytes``): past either, the whole run is killed
  3. the status comes from the wait status, never from text the child printed: bwrap exits with the
     program's exit code, or 128 + N when a signal N killed it (SIGXCPU: the CPU limit); the launcher's
     exit code for an uncaught MemoryError is ``EXIT_MEMORY`` (a child faking one only mislabels its own
     failure)
  4. cleanup (kill, reap) never raises and never blocks past a short grace; a run that cannot even start is
     status ``sandbox_error``, and its sample scores 0 like any failure, while the rollout worker goes on

Statuses: ok, error (exit code != 0), timeout (wall clock), cpu_limit, memory_limit, output_limit, killed (any
other signal), sandbox_error (the run could not be started).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from reflow.envs.cgroups import RunCgroup, detect
from reflow.envs.isolation import LAUNCHER_SOURCE, KernelBoundary, Mounts, SandboxUnavailable

logger = logging.getLogger("reflow")

EXIT_MEMORY = 247
"""The launcher's exit code for a MemoryError the code did not catch (``sandbox_child``)."""
KILL_GRACE_S = 5.0
"""How long a killed run may take to be reaped before a background thread takes the wait over."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock seconds before the whole run is killed (a sleeping or blocked program, or one that will not
    close its output)."""
    cpu_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU): an endless loop is stopped by SIGXCPU."""
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
    processes: int = 64
    """Processes of the run (RLIMIT_NPROC, counted in the run's own user namespace): a bound on a fork bomb."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""


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


def _memory_file(name: str, data: bytes) -> int:
    """A file descriptor on an anonymous in-memory file holding ``data``, at offset 0 (the parent's own)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Sandbox:
    def __init__(
        self, limits: SandboxLimits | None = None, allow_unisolated: bool = False, python: str = "",
        boundary: KernelBoundary | None = None, audit_hook: bool = True, kernel: bool = True,
    ):
        """``python``: the interpreter to run the code with ("": chosen by ``isolation.choose_interpreter``);
        ``boundary``: a checked one (else ``KernelBoundary.for_host``); ``audit_hook``: the third layer;
        ``kernel=False`` (with ``allow_unisolated``): no kernel boundary even where the host has one (the
        benchmark's comparison)."""
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
                self.boundary = KernelBoundary.for_host(python)
            except SandboxUnavailable as error:
                if not allow_unisolated:
                    raise
                _warn_unisolated(str(error))
        self.python = self.boundary.interpreter.executable if self.boundary is not None else (python or sys.executable)
        self.cgroups = detect() if self.boundary is not None else None
        """Where per-run cgroups are made (``reflow.envs.cgroups``), or None: the bounds are per process."""

    @property
    def isolation(self) -> list[str]:
        """The layers in force (module docstring)."""
        kernel = ["namespaces", "unprivileged user", "read-only root", "seccomp"] if self.boundary is not None else []
        cgroup = [f"cgroup v{self.cgroups.version} (memory and processes per run)"] if self.cgroups is not None else []
        return kernel + cgroup + ["limits", "cleared environment"] + (["audit hook"] if self.audit_hook else [])

    def _launcher_args(self) -> list[str]:
        return [json.dumps(asdict(self.limits) | {"audit_hook": self.audit_hook, "exit_memory": EXIT_MEMORY})]

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` (stdin: ``stdin``) to its end or a limit; never raises for what the code does."""
        t0 = time.perf_counter()
        spawn = _Spawn()
        try:
            spawn.fds.append(_memory_file("stdin", stdin.encode("utf-8", errors="replace")))
            if self.boundary is not None:
                self._spawn_kernel(spawn, code)
            else:
                self._spawn_unisolated(spawn, code)
        except OSError as error:
            spawn.abandon()
            logger.warning(f"sandbox: could not start a run: {error}")
            return SandboxResult("sandbox_error", "", f"sandbox: {error}", None, time.perf_counter() - t0)
        try:
            return _supervise(spawn.process, self.limits, t0, spawn.cgroup)
        finally:
            spawn.finish()

    def _spawn_kernel(self, spawn: "_Spawn", code: str) -> None:
        """bwrap, as the sandbox user; with a per-run cgroup, bwrap waits (``--block-fd``) until its two
        processes are in it, so that the program and everything it starts are too."""
        limits, boundary = self.limits, self.boundary
        code_fd = spawn.keep(_memory_file("code", code.encode("utf-8", errors="replace")))
        launcher_fd = spawn.keep(_memory_file("launcher", boundary.launcher))
        seccomp_fd = spawn.keep(_memory_file("seccomp", boundary.filter))
        passed = [code_fd, launcher_fd, seccomp_fd]
        handshake: list[str] = []
        if self.cgroups is not None:
            run_bytes = (limits.memory_mb + 2 * limits.disk_mb + limits.shm_mb) << 20
            spawn.cgroup = RunCgroup(self.cgroups, run_bytes, limits.processes)
            info_read, info_write = (spawn.keep(fd) for fd in os.pipe())
            block_read, block_write = (spawn.keep(fd) for fd in os.pipe())
            passed += [info_write, block_read]
            handshake = ["--info-fd", str(info_write), "--block-fd", str(block_read)]
        mounts = Mounts(limits.disk_mb << 20, limits.disk_mb << 20, limits.shm_mb << 20)
        command = boundary.arguments(mounts, code_fd, launcher_fd, seccomp_fd, self._launcher_args(), handshake)
        user = dict(user=boundary.uid, group=boundary.uid, extra_groups=[]) if boundary.uid is not None else {}
        spawn.start(command, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, "/", passed, user)
        if spawn.cgroup is not None:
            spawn.close_passed()
            child = _read_child_pid(info_read, deadline=time.perf_counter() + 10.0)
            spawn.cgroup.attach(spawn.process.pid)
            spawn.cgroup.attach(child)
            os.write(block_write, b"x")

    def _spawn_unisolated(self, spawn: "_Spawn", code: str) -> None:
        spawn.workdir = tempfile.mkdtemp(prefix="reflow-sandbox-")
        with open(os.path.join(spawn.workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": spawn.workdir, "TMPDIR": spawn.workdir}
        spawn.start([self.python, "-I", LAUNCHER_SOURCE, *self._launcher_args()], env, spawn.workdir, [], {})


class _Spawn:
    """One run's start: the descriptors and folder it needs, the process, its cgroup; and their cleanup."""

    def __init__(self):
        self.fds: list[int] = []
        self.passed: list[int] = []
        self.workdir: str | None = None
        self.process: subprocess.Popen | None = None
        self.cgroup: RunCgroup | None = None

    def keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def start(self, command: list[str], env: dict, cwd: str, passed: list[int], user: dict) -> None:
        self.passed = passed
        self.process = subprocess.Popen(
            command, stdin=self.fds[0], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
            start_new_session=True, close_fds=True, pass_fds=tuple(passed), **user,
        )

    def close_passed(self) -> None:
        """The descriptors bwrap has its own copies of (the ends it reads or writes)."""
        for fd in self.passed:
            _close(fd)
            if fd in self.fds:
                self.fds.remove(fd)
        self.passed = []

    def abandon(self) -> None:
        """A start that failed: kill what started, before the block descriptor closes (a closed one would let
        bwrap go on outside its cgroup)."""
        if self.process is not None:
            _kill(self.process)
            _reap_killed(self.process)
            for handle in (self.process.stdout, self.process.stderr):
                try:
                    handle.close()
                except OSError:
                    pass
        self.finish()

    def finish(self) -> None:
        for fd in self.fds:
            _close(fd)
        self.fds = []
        _remove(self.workdir)
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None


def _read_child_pid(fd: int, deadline: float) -> int:
    """bwrap's ``--info-fd`` JSON: the host pid of its child (the sandbox's init)."""
    data = b""
    while time.perf_counter() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.perf_counter()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError):
            continue
    raise OSError(errno.EIO, f"bwrap reported no child pid (got {data[:200]!r})")


def _warn_unisolated(why: str) -> None:
    logger.warning(
        f"SANDBOX WITHOUT KERNEL ISOLATION: {why}. task.sandbox_allow_unisolated = true: model-written code runs "
        "as this user with resource limits and an audit hook only, which hostile code can get past"
    )


class _Output:
    """One pipe's bytes: the first ``keep`` of them, and how many came."""

    def __init__(self, keep: int):
        self.keep = keep
        self.head = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]

    def text(self) -> str:
        return self.head.decode("utf-8", errors="replace")


def _supervise(process: subprocess.Popen, limits: SandboxLimits, t0: float, cgroup: RunCgroup | None) -> SandboxResult:
    """Steps 2-4 of the module docstring: read both pipes until they close and the run has exited, within the
    deadline and the output cap; kill the run otherwise; reap it and read its status."""
    deadline = t0 + limits.wall_s
    outputs = {process.stdout.fileno(): _Output(limits.output_bytes), process.stderr.fileno(): _Output(limits.output_bytes)}
    selector = selectors.DefaultSelector()
    for fd in outputs:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    try:
        pidfd = os.pidfd_open(process.pid)
        selector.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pidfd = None  # a kernel before 5.3: poll for the exit instead
    verdict, reaped, drain_until = None, None, 0.0
    pipes = set(outputs)
    try:
        while True:
            now = time.perf_counter()
            if reaped is not None and (not pipes or now >= drain_until):
                break  # exited, and its output is read (the pipes closed, or a second passed)
            if reaped is None and now >= deadline:
                verdict = "timeout"
                break
            if sum(o.total for o in outputs.values()) > limits.output_cap_bytes:
                verdict = "output_limit"
                break
            if reaped is None and pidfd is None:
                reaped = _reap(process.pid, block=False)
                if reaped is not None:
                    drain_until = now + 1.0
                    continue
            wait = (drain_until if reaped is not None else deadline) - now
            if reaped is None and pidfd is None:
                wait = min(wait, 0.02)
            for key, _ in selector.select(max(wait, 0.0)):
                if key.fd == pidfd:
                    selector.unregister(pidfd)
                    reaped = _reap(process.pid, block=True)
                    drain_until = time.perf_counter() + 1.0
                    continue
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    outputs[key.fd].add(data)
                else:
                    selector.unregister(key.fd)
                    pipes.discard(key.fd)
        if verdict is not None or reaped is None:
            _kill(process)
            if reaped is None:
                reaped = _reap_killed(process)
    finally:
        selector.close()
        for handle in (process.stdout, process.stderr):
            try:
                handle.close()
            except OSError:
                pass
        if pidfd is not None:
            _close(pidfd)
    wall_s = time.perf_counter() - t0
    stdout_output, stderr_output = list(outputs.values())
    truncated = any(o.total > o.keep for o in outputs.values())
    if reaped is None:
        return SandboxResult(verdict or "killed", stdout_output.text(), stderr_output.text(), None, wall_s, truncated)
    exit_code = os.waitstatus_to_exitcode(reaped)
    process.returncode = exit_code  # reaped here: Popen must not wait for it again
    if verdict is None and exit_code != 0 and cgroup is not None and cgroup.oom_kills():
        verdict = "memory_limit"  # the run's cgroup reached its memory bound: the kernel's count says so
    return SandboxResult(verdict or _status(exit_code), stdout_output.text(), stderr_output.text(), exit_code, wall_s, truncated)


def _status(exit_code: int) -> str:
    """From the wait status: bwrap exits with 128 + N when the program died of signal N (without the kernel
    boundary, the launcher's own wait status says the same as -N)."""
    if exit_code == 0:
        return "ok"
    if exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "cpu_limit"
    if exit_code == EXIT_MEMORY:
        return "memory_limit"
    if exit_code > 128 or exit_code < 0:
        return "killed"
    return "error"


def _reap(pid: int, block: bool) -> int | None:
    """The wait status of ``pid`` once it exited, else None (``block``: wait for it)."""
    try:
        done, status_word = os.waitpid(pid, 0 if block else os.WNOHANG)
    except (ChildProcessError, InterruptedError):
        return None
    return status_word if done == pid else None


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group; the run's own processes die with it (--die-with-parent, and the end of
    their PID namespace)."""
    for target in (lambda: os.killpg(process.pid, signal.SIGKILL), lambda: os.kill(process.pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _reap_killed(process: subprocess.Popen):
    """Reap a killed run within ``KILL_GRACE_S``; past it, a background thread waits (nothing here blocks)."""
    until = time.perf_counter() + KILL_GRACE_S
    while time.perf_counter() < until:
        reaped = _reap(process.pid, block=False)
        if reaped is not None:
            return reaped
        time.sleep(0.005)
    logger.warning(f"sandbox: run {process.pid} not reaped {KILL_GRACE_S:.0f}s after SIGKILL; a thread waits for it")
    threading.Thread(target=_reap, args=(process.pid, True), daemon=True, name="sandbox-reaper").start()
    process.returncode = -signal.SIGKILL
    return None


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _remove(folder: str | None) -> None:
    if folder is None:
        return
    import shutil

    try:
        shutil.rmtree(folder, ignore_errors=True)
    except Exception:  # noqa: BLE001 - cleanup never raises
        pass


__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "EXIT_MEMORY"]
