"""The sandbox's boundary: kernel isolation through bubblewrap (``bwrap``, Debian package ``bubblewrap``),
a tool made for running untrusted programs without privileges.

Each sandbox run is one ``bwrap`` process. On a host where the rollout worker runs as root it is started as the
unprivileged host user ``nobody`` (uid 65534; elsewhere as the worker's own user), so that no process of the
run is root on the host, in any namespace, at any moment. bwrap gives it:

  namespaces   new user, mount, PID, IPC, UTS, network and cgroup namespaces (``--unshare-all``), and no
               further user namespaces inside (``--disable-userns``)
  user         uid and gid 65534 inside too, no capabilities, no_new_privs
  files        a root of bwrap's own, read-only (``--remount-ro /``), holding only: the interpreter, its
               standard library and the shared libraries they load, each bound read-only from the host; a
               private ``/proc`` of the run's PID namespace (kernel addresses and host-wide tables masked); a
               ``/dev`` of null, zero, full, random and urandom only (no pseudo-terminals), read-only;
               size-limited tmpfs mounts at ``/work`` (the working
               directory), ``/tmp`` and ``/dev/shm``; the code at ``/work/main.py`` and the launcher
               (``reflow.envs.sandbox_child``), both copied in read-only. Nothing of the host is writable
               from inside, and nothing else of it is there: no /etc, no home, no sockets.
  process      the launcher is the namespace's init (``--as-pid-1``), so every process of the run descends
               from it after its resource limits; the parent ends every run by SIGKILL to it through a
               process descriptor, which takes the whole PID namespace with it; ``--die-with-parent`` (a
               run cannot outlive the rollout worker), ``--new-session`` (no
               controlling terminal), a cleared environment from bwrap's own start (it is spawned with
               none; PATH, HOME and LANG are set for the code), the seccomp filter of
               ``reflow.envs.seccomp`` loaded just before the interpreter starts
  network      only the namespace's own loopback: the host's (its 127.0.0.1 listeners, its abstract UNIX
               sockets) is another namespace's

``KernelBoundary.for_host()`` finds bwrap and an interpreter the sandbox user can reach, and
``reflow.envs.sandbox.checked_boundary`` runs one probe sandbox in it; anything missing raises ``SandboxUnavailable``,
one line saying what is missing and how to install
it (``reflow.train --check`` prints it before torchrun starts any rank).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass

from reflow.envs import seccomp

SANDBOX_UID = 65534
"""The unprivileged user a root host runs the sandbox as (``nobody``), and the uid inside."""
WORKDIR = "/work"
LAUNCHER_PATH = "/sandbox/launch.py"
LAUNCHER_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
SYSTEM_PYTHON = "/usr/bin/python3"

INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap)"
USERNS_HINT = (
    "unprivileged user namespaces are not available: enable them (sysctl user.max_user_namespaces=15000; "
    "kernel.unprivileged_userns_clone=1 on older Debian kernels; on Ubuntu 23.10+ "
    "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap)"
)
OPT_OUT = "task.sandbox_allow_unisolated = true runs model code without it (unsafe)"


class SandboxUnavailable(ValueError):
    """The kernel boundary cannot be set up on this host (one line: what is missing, how to get it)."""


def host_user() -> int | None:
    """The host uid to start bwrap as: ``nobody`` where this process is root, else None (this process's)."""
    return SANDBOX_UID if os.geteuid() == 0 else None


def reachable(path: str, uid: int | None) -> bool:
    """Whether ``uid`` (None: this process's user) can read ``path`` and search every folder above it, by the
    permission bits (the sandbox user is in no group that owns the Python installation)."""
    if uid is None:
        return os.access(path, os.R_OK)
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    for depth in range(1, len(parts) + 1):
        current = os.sep.join(parts[:depth]) or os.sep
        try:
            info = os.stat(current)
        except OSError:
            return False
        is_leaf = depth == len(parts)
        need = (stat.S_IROTH if is_leaf else stat.S_IXOTH, stat.S_IRUSR if is_leaf else stat.S_IXUSR)
        if not (info.st_mode & need[0] or (info.st_uid == uid and info.st_mode & need[1])):
            return False
    return True


@dataclass(frozen=True)
class InterpreterView:
    """What the sandboxed interpreter needs of the host, bound read-only at the same paths."""

    executable: str
    paths: tuple[str, ...]
    """The executable, its standard library (with lib-dynload), the shared libraries of both and the loader."""


PROBE = (
    "import json, os, sys, sysconfig\n"
    "print(json.dumps({'executable': os.path.realpath(sys.executable), 'implementation': sys.implementation.name,"
    " 'stdlib': sysconfig.get_path('stdlib'), 'platstdlib': sysconfig.get_path('platstdlib'),"
    " 'dynload': sysconfig.get_config_var('DESTSHARED')}))"
)
LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def _shared_libraries(binaries: list[str]) -> set[str]:
    """The shared libraries ``ldd`` resolves for these (trusted) binaries, and the dynamic loader."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("ldd (glibc's libc-bin) not found: the sandbox needs it to find the interpreter's libraries")
    found: set[str] = set()
    for start in range(0, len(binaries), 64):
        done = subprocess.run([ldd, *binaries[start : start + 64]], capture_output=True, text=True, timeout=60)
        for line in done.stdout.splitlines():
            match = LDD_LINE.match(line)
            if match:
                found.add(match.group(1))
    return found


@functools.lru_cache(maxsize=4)
def interpreter_view(python: str) -> InterpreterView:
    """Ask ``python`` where its files are (a trusted run on the host, once per process)."""
    try:
        done = subprocess.run([python, "-I", "-c", PROBE], capture_output=True, text=True, timeout=60, env={})
        info = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        raise SandboxUnavailable(f"the sandbox interpreter {python} did not start: {error}") from None
    if info["implementation"] != "cpython":
        raise SandboxUnavailable(f"the sandbox interpreter {python} is {info['implementation']}, not CPython")
    folders = {os.path.realpath(p) for p in (info["stdlib"], info["platstdlib"], info["dynload"]) if p}
    extensions = sorted(
        os.path.join(info["dynload"], name) for name in os.listdir(info["dynload"]) if name.endswith(".so")
    ) if info["dynload"] and os.path.isdir(info["dynload"]) else []
    libraries = _shared_libraries([info["executable"], *extensions])
    paths = {info["executable"], *libraries, *folders}
    if os.path.exists("/etc/ld.so.cache"):
        paths.add("/etc/ld.so.cache")  # the loader's index of library folders: no secrets, and quicker starts
    # a folder inside another one bound already needs no bind of its own
    kept = sorted(p for p in paths if not any(p != q and p.startswith(q + os.sep) for q in folders))
    return InterpreterView(info["executable"], tuple(kept))


def choose_interpreter(requested: str, uid: int | None) -> str:
    """``task.sandbox_python`` if set, else this Python's base interpreter when the sandbox user can reach it
    (a Python under a private home folder it cannot), else the system's ``/usr/bin/python3``."""
    candidates = [requested] if requested else [getattr(sys, "_base_executable", sys.executable), SYSTEM_PYTHON]
    for candidate in candidates:
        if candidate and os.path.exists(candidate) and reachable(candidate, uid):  # (every folder above it too)
            return candidate
    tried = ", ".join(c for c in candidates if c)
    raise SandboxUnavailable(
        f"no Python interpreter the sandbox user (uid {uid if uid is not None else os.geteuid()}) can read: tried {tried}; "
        "install python3 system-wide or set task.sandbox_python to one under world-readable folders"
    )


DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
PROC_MASKED = ("/proc/kallsyms", "/proc/kcore", "/proc/keys", "/proc/key-users", "/proc/timer_list", "/proc/sched_debug",
               "/proc/sysrq-trigger", "/proc/latency_stats", "/proc/slabinfo", "/proc/vmallocinfo",
               # the host's identity: its kernel build, boot command line and boot id
               "/proc/config.gz", "/proc/cmdline", "/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class BwrapDescriptors:
    """The descriptors bwrap reads (the code, the launcher, the filter, the block) and writes (its info)."""

    code: int
    launcher: int
    seccomp: int
    info: int
    block: int


@dataclass(frozen=True)
class Mounts:
    """The sizes of the run's writable tmpfs mounts (bytes)."""

    work_bytes: int
    tmp_bytes: int
    shm_bytes: int


class KernelBoundary:
    """The bwrap command line of one run (module docstring), for one host and interpreter."""

    def __init__(
        self, bwrap: str, interpreter: InterpreterView, uid: int | None, seccomp_filter: bytes, setpriv: str | None = None,
    ):
        self.bwrap = bwrap
        self.interpreter = interpreter
        self.uid = uid
        """Host uid bwrap is started as (None: this process's)."""
        self.setpriv = setpriv if uid is not None else None
        """util-linux's ``setpriv``, where bwrap is started as another user and the host has it: the spawned
        process drops to ``uid`` (real, effective and saved ids, no groups, no capabilities) and then executes
        bwrap. Without it the worker's ``Popen(user=...)`` switches the user itself, and Python must then
        ``fork`` rather than ``vfork``: a copy of the worker's page tables per run, which in a rollout worker
        holding an engine costs more than the run (3 GB resident: 163 ms a run against 31 ms)."""
        self.filter = seccomp_filter
        """``seccomp.program()``: what bwrap loads before the launcher starts."""
        with open(LAUNCHER_SOURCE, "rb") as f:
            self.launcher = f.read()

    @classmethod
    def for_host(cls, python: str = "") -> "KernelBoundary":
        """The boundary this host's tools allow (bwrap, the filter, an interpreter the sandbox user reaches), not
        yet tried: ``reflow.envs.sandbox.checked_boundary`` runs the probe that proves it."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(f"bubblewrap (bwrap) not found on PATH: {INSTALL_HINT}")
        try:
            seccomp_filter = seccomp.program()
        except seccomp.SeccompUnsupported as error:
            raise SandboxUnavailable(str(error)) from None
        uid = host_user()
        if not reachable(bwrap, uid):
            raise SandboxUnavailable(f"{bwrap} is not executable by uid {uid}")
        return cls(bwrap, interpreter_view(choose_interpreter(python, uid)), uid, seccomp_filter, shutil.which("setpriv"))

    def spawn_command(self, mounts: Mounts, fds: "BwrapDescriptors", launcher_args: list[str]) -> list[str]:
        """What the worker executes: bwrap's command line (``arguments``), behind ``setpriv`` where that switches
        the user (setpriv executes bwrap in the same process: the pid the worker watches is bwrap's)."""
        drop = []
        if self.setpriv is not None:
            drop = [self.setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--"]
        return drop + self.arguments(mounts, fds, launcher_args)

    def spawn_user(self) -> dict:
        """``Popen``'s user switch, where ``setpriv`` does not make it (``spawn_command``)."""
        if self.uid is None or self.setpriv is not None:
            return {}
        return dict(user=self.uid, group=self.uid, extra_groups=[])

    def arguments(
        self, mounts: Mounts, fds: "BwrapDescriptors", launcher_args: list[str],
    ) -> list[str]:
        """The command line: bwrap's options, then the interpreter running the launcher. bwrap reports its
        child's pid on ``fds.info`` and waits on ``fds.block`` before the program starts (the parent's
        handshake: a process descriptor to end the run by, and the cgroup)."""
        args = [
            self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8",
            "--setenv", "TMPDIR", "/tmp",
        ]
        for path in self.interpreter.paths:
            args += ["--ro-bind", path, path]
        args += ["--proc", "/proc"]
        for path in PROC_MASKED:  # kernel addresses and host-wide state: read as empty
            if os.path.exists(path):
                args += ["--ro-bind", "/dev/null", path]
        # a /dev of the few nodes a program reads, and no devpts (its pseudo-terminals are a host-wide pool)
        args += ["--tmpfs", "/dev"]
        for node in DEV_NODES:
            args += ["--dev-bind", node, node]
        args += ["--symlink", "/proc/self/fd", "/dev/fd"]
        args += [
            "--size", str(mounts.shm_bytes), "--tmpfs", "/dev/shm",
            "--size", str(mounts.tmp_bytes), "--tmpfs", "/tmp",
            "--size", str(mounts.work_bytes), "--tmpfs", WORKDIR,
            "--perms", "0444", "--ro-bind-data", str(fds.code), f"{WORKDIR}/main.py",
            "--perms", "0444", "--ro-bind-data", str(fds.launcher), LAUNCHER_PATH,
            "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", WORKDIR, "--seccomp", str(fds.seccomp), "--info-fd", str(fds.info), "--block-fd", str(fds.block),
            "--", self.interpreter.executable, "-I", LAUNCHER_PATH, *launcher_args,
        ]
        return args
