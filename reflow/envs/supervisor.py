"""One sandbox run's processes, from start to teardown: what ``reflow.envs.sandbox.Sandbox.run`` drives.

Who waits for whom, in the kernel boundary (``reflow.envs.isolation``):

  1. start     the parent spawns bwrap (the "outer" process; as the sandbox user on a root host, through setpriv
               where the host has it: ``KernelBoundary.spawn_command``) with the code,
               launcher and filter as memory files and stdin as a read-only one. bwrap builds the namespaces,
               writes its child's host pid on the info pipe, and waits on the block pipe. Its child becomes
               the launcher, as the sandbox's init (``--as-pid-1``: there is no other process in the
               namespace, such as a reaper of bwrap's, that the program could take over through /proc/1/mem
               and that would not carry the launcher's resource limits).
  2. handshake the parent opens a process descriptor on the init and on bwrap, moves both into the run's
               cgroup if there is one, hands both descriptors to the worker's guardian and waits for it to
               confirm (``reflow.envs.guardian``: the run dies with the worker, whatever the program does to
               its own parent-death signal), and writes one byte on the block pipe. bwrap mounts, loads the
               seccomp filter and executes the launcher, which sets the limits and runs the program. A
               handshake that fails kills bwrap before the block pipe closes (a closed pipe would let it go on).
  3. supervise the parent reads stdout and stderr (non-blocking, through one selector, with bwrap's process
               descriptor in it for the exit) until bwrap has exited and both pipes closed, or the deadline,
               or the output cap; a verdict kills. Nothing here blocks past the deadline: the reads are
               non-blocking and the selector's timeout is the time left.
  4. teardown  always, whatever happened: SIGKILL to the init through its descriptor (a PID namespace's
               init killed from outside takes every process of the namespace with it, so nothing of the run
               outlives ``run``), SIGKILL to bwrap if it has not exited, then wait (bounded) for the init's
               descriptor to report its exit and reap bwrap; then the cgroup is removed and the descriptors
               closed. Processes are signalled through descriptors only, never by pid, so a recycled pid is
               never hit. Nothing here raises; a wait past ``KILL_GRACE_S`` goes on in a background thread.

Why it cannot deadlock: the parent's only blocking calls are the selector (bounded by the deadline), the info
pipe read (bounded), and waits on descriptors of processes it has already sent SIGKILL (bounded by the grace).
The child never waits on the parent after step 2.

Without the kernel boundary (``task.sandbox_allow_unisolated``) the run is the launcher alone, in its own
process group: steps 2 and 4's init and cgroup do not exist, and teardown kills the process group.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from reflow.envs.cgroups import CgroupLayout, RunCgroup
from reflow.envs.guardian import Guardian
from reflow.envs.isolation import LAUNCHER_SOURCE, BwrapDescriptors, KernelBoundary, Mounts

logger = logging.getLogger("reflow")

KILL_GRACE_S = 5.0
"""How long a killed run may take to be gone before a background thread takes the wait over."""
DRAIN_S = 1.0
"""After bwrap exited: how long its pipes may stay open (the namespace's last processes dying)."""
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


F_ADD_SEALS = 1033
SEALED = 0x0001 | 0x0002 | 0x0004 | 0x0008
"""F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE: the file's bytes can never change again."""


def memory_file(name: str, data: bytes) -> int:
    """A descriptor on an anonymous in-memory file holding ``data``, at offset 0 (the parent's own), sealed:
    a read-write reopen through ``/proc/self/fd`` (which the file's mode would allow) still cannot write it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        fcntl.fcntl(fd, F_ADD_SEALS, SEALED)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_only(fd: int) -> int:
    """A new, read-only open of the file behind ``fd`` (the run's stdin: it cannot write to it)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


@dataclass
class Outcome:
    verdict: str | None
    """timeout | output_limit | memory_limit (the cgroup's OOM count) when the parent decided, else None."""
    exit_code: int | None
    """bwrap's exit code (the program's, or 128 + N when signal N killed it); None if unknown."""
    stdout: str
    stderr: str
    truncated: bool


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


class RunProcess:
    """The processes, descriptors, folder and cgroup of one run (module docstring)."""

    def __init__(self):
        self.fds: list[int] = []
        """Descriptors this object closes at teardown."""
        self.process: subprocess.Popen | None = None
        self.outer_fd: int | None = None
        """Process descriptor of bwrap (or, without the boundary, of the launcher)."""
        self.init_fd: int | None = None
        """Process descriptor of the sandbox's init (pid 1 inside)."""
        self.status_word: int | None = None
        """bwrap's wait status, once reaped."""
        self.reaped = False
        self.cgroup: RunCgroup | None = None
        self.workdir: str | None = None
        self.guardian: Guardian | None = None
        """The worker's guardian, holding this run's descriptors (None until it confirmed)."""
        self.run_id = os.urandom(16)

    def _keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def _drop(self, fd: int) -> None:
        if fd in self.fds:
            self.fds.remove(fd)
        _close(fd)

    # ---- 1 and 2: start and handshake -----------------------------------------------------------------

    @classmethod
    def start_kernel(
        cls, boundary: KernelBoundary, limits, code: str, stdin: str, launcher_args: list[str],
        cgroups: CgroupLayout | None,
    ) -> "RunProcess":
        run = cls()
        try:
            run._start_kernel(boundary, limits, code, stdin, launcher_args, cgroups)
        except BaseException:
            run.end()
            raise
        return run

    def _start_kernel(self, boundary, limits, code, stdin, launcher_args, cgroups) -> None:
        stdin_fd = self._stdin(stdin)
        info_read, info_write = (self._keep(fd) for fd in os.pipe())
        block_read, block_write = (self._keep(fd) for fd in os.pipe())
        fds = BwrapDescriptors(
            code=self._keep(memory_file("code", code.encode("utf-8", errors="replace"))),
            launcher=self._keep(memory_file("launcher", boundary.launcher)),
            seccomp=self._keep(memory_file("seccomp", boundary.filter)),
            info=info_write, block=block_read,
        )
        if cgroups is not None:
            run_bytes = (limits.memory_mb + 2 * limits.disk_mb + limits.shm_mb) << 20
            self.cgroup = RunCgroup(cgroups, run_bytes, limits.processes)
        mounts = Mounts(limits.disk_mb << 20, limits.disk_mb << 20, limits.shm_mb << 20)
        passed = (fds.code, fds.launcher, fds.seccomp, fds.info, fds.block)
        command = boundary.spawn_command(mounts, fds, launcher_args)
        self._spawn(command, ENVIRONMENT, "/", stdin_fd, passed, boundary.spawn_user())
        for fd in passed:
            self._drop(fd)  # bwrap holds its own copies
        init_pid = _read_child_pid(info_read, deadline=time.perf_counter() + 10.0)
        self.init_fd = self._keep(os.pidfd_open(init_pid))
        if self.cgroup is not None:
            self.cgroup.attach(self.process.pid)
            self.cgroup.attach(init_pid)
        self._guard([self.init_fd, self.outer_fd])
        os.write(block_write, b"x")

    def _guard(self, fds: list[int]) -> None:
        """The worker's guardian holds the run's descriptors before its program starts."""
        guardian = Guardian.get()
        guardian.watch(self.run_id, fds)
        self.guardian = guardian

    @classmethod
    def start_unisolated(cls, python: str, code: str, stdin: str, launcher_args: list[str]) -> "RunProcess":
        run = cls()
        try:
            stdin_fd = run._stdin(stdin)
            run.workdir = tempfile.mkdtemp(prefix="reflow-sandbox-")
            with open(os.path.join(run.workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            env = ENVIRONMENT | {"HOME": run.workdir, "TMPDIR": run.workdir}
            run._spawn([python, "-I", LAUNCHER_SOURCE, *launcher_args], env, run.workdir, stdin_fd, (), {})
            run._guard([run.outer_fd])
        except BaseException:
            run.end()
            raise
        return run

    def _stdin(self, text: str) -> int:
        writable = self._keep(memory_file("stdin", text.encode("utf-8", errors="replace")))
        return self._keep(read_only(writable))

    def _spawn(self, command: list[str], env: dict, cwd: str, stdin_fd: int, passed: tuple, user: dict) -> None:
        self.process = subprocess.Popen(
            command, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
            start_new_session=True, close_fds=True, pass_fds=passed, **user,
        )
        self.outer_fd = self._keep(os.pidfd_open(self.process.pid))

    # ---- 3: supervise ----------------------------------------------------------------------------------

    def supervise(self, limits, t0: float) -> Outcome:
        deadline = t0 + limits.wall_s
        process = self.process
        outputs = {process.stdout.fileno(): _Output(limits.output_bytes), process.stderr.fileno(): _Output(limits.output_bytes)}
        selector = selectors.DefaultSelector()
        verdict, drain_until = None, 0.0
        try:
            for fd in outputs:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            selector.register(self.outer_fd, selectors.EVENT_READ)
            pipes, exited = set(outputs), False
            while True:
                now = time.perf_counter()
                if exited and (not pipes or now >= drain_until):
                    break  # exited, and its output is read (both pipes closed, or the drain time passed)
                if not exited and now >= deadline:
                    verdict = "timeout"
                    break
                if sum(o.total for o in outputs.values()) > limits.output_cap_bytes:
                    verdict = "output_limit"
                    break
                wait = (drain_until if exited else deadline) - now
                for key, _ in selector.select(max(wait, 0.0)):
                    if key.fd == self.outer_fd:
                        selector.unregister(self.outer_fd)
                        if self.init_fd is None:
                            _killpg(process.pid)  # without the boundary: what the launcher left in its group
                        self._reap(block=True)
                        exited, drain_until = True, time.perf_counter() + DRAIN_S
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
        finally:
            selector.close()
        if verdict is None and self.cgroup is not None and self.exit_code not in (0, None) and self.cgroup.oom_kills():
            verdict = "memory_limit"  # the run's cgroup reached its bound: the kernel's own count says so
        stdout, stderr = outputs.values()
        return Outcome(verdict, self.exit_code, stdout.text(), stderr.text(), any(o.total > o.keep for o in outputs.values()))

    @property
    def exit_code(self) -> int | None:
        return os.waitstatus_to_exitcode(self.status_word) if self.status_word is not None else None

    def _reap(self, block: bool) -> bool:
        """Reap bwrap (once); True when it is reaped. A SIGCHLD set to SIG_IGN by the application makes the
        kernel reap it itself (ECHILD): it has exited, its status is unknown."""
        if self.reaped or self.process is None:
            return True
        try:
            done, status_word = os.waitpid(self.process.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done, status_word = self.process.pid, None
        except InterruptedError:
            return False
        if done != self.process.pid:
            return False
        self.reaped, self.status_word = True, status_word
        self.process.returncode = self.exit_code if status_word is not None else -signal.SIGKILL  # Popen must not wait
        return True

    # ---- 4: teardown -----------------------------------------------------------------------------------

    def end(self) -> None:
        """Step 4 (module docstring); never raises, never blocks past ``KILL_GRACE_S``."""
        try:
            self._end()
        except Exception as error:  # noqa: BLE001 - teardown must not take the rollout worker down
            logger.warning(f"sandbox: teardown failed: {error!r}")

    def _end(self) -> None:
        for fd in (self.init_fd, None if self.reaped else self.outer_fd):
            if fd is not None:
                _pidfd_kill(fd)
        if self.process is not None and self.init_fd is None and not self.reaped:
            _killpg(self.process.pid)  # without the boundary: the launcher's group (it has not been reaped)
        until = time.perf_counter() + KILL_GRACE_S
        gone = _wait_readable(self.init_fd, until) if self.init_fd is not None else True
        while self.process is not None and not self._reap(block=False) and time.perf_counter() < until:
            _wait_readable(self.outer_fd, min(until, time.perf_counter() + 0.05))
        if self.process is not None:
            for handle in (self.process.stdout, self.process.stderr):
                try:
                    handle.close()
                except OSError:
                    pass
        if not (gone and self.reaped):
            logger.warning(f"sandbox: run {self.process.pid if self.process else '?'} not gone {KILL_GRACE_S:.0f}s "
                           "after SIGKILL; a thread waits")
            threading.Thread(target=self._finish_later, daemon=True, name="sandbox-teardown").start()
            return
        self._release()

    def _finish_later(self) -> None:
        if self.init_fd is not None:
            _wait_readable(self.init_fd, time.perf_counter() + 600)
        if self.process is not None and not self.reaped:
            self._reap(block=True)
        self._release()

    def _release(self) -> None:
        if self.guardian is not None:
            self.guardian.forget(self.run_id)
            self.guardian = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        for fd in self.fds:
            _close(fd)
        self.fds = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def _read_child_pid(fd: int, deadline: float) -> int:
    """bwrap's ``--info-fd`` JSON: the host pid of its child (the sandbox's init)."""
    data = b""
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    try:
        while time.perf_counter() < deadline:
            if not selector.select(max(0.0, deadline - time.perf_counter())):
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
            try:
                return int(json.loads(data)["child-pid"])
            except (ValueError, KeyError):
                continue
    finally:
        selector.close()
    raise OSError(errno.EIO, f"bwrap reported no child pid (got {data[:200]!r})")


def _wait_readable(fd: int, until: float) -> bool:
    """Whether ``fd`` (a process descriptor: its process exited) became readable before ``until``."""
    selector = selectors.DefaultSelector()
    try:
        selector.register(fd, selectors.EVENT_READ)
        return bool(selector.select(max(0.0, until - time.perf_counter())))
    except (OSError, ValueError):
        return True  # closed already: nothing to wait for
    finally:
        selector.close()


def _pidfd_kill(fd: int) -> None:
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (ProcessLookupError, OSError):
        pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
