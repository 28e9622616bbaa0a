"""Per-run control groups: the sandbox's bound on a run's total memory and process count, where the host lets
this process create cgroups (a writable cgroup v1 ``memory`` and ``pids`` hierarchy, or a cgroup v2 subtree
with both controllers delegated). Without one, the bounds are per process: RLIMIT_AS for each of at most
``processes`` processes, and the tmpfs sizes.

With one, each run gets a cgroup of its own under this process's, holding every process of the run (bwrap's two
are moved in while bwrap waits on ``--block-fd``, before the program is forked):

  memory   the run's ``memory_mb`` plus its tmpfs sizes, for the whole run, page cache and tmpfs pages
           (the working directory, /tmp, /dev/shm) included, and no swap; past it the kernel's OOM killer ends a process
           of the run, which
           the parent reads back as ``memory_limit`` from the cgroup's own OOM-kill count
  pids     ``processes`` for the whole run (a fork bomb stops there, whatever user the processes run as)

Removal (after the run's processes are gone) never raises and never blocks: a cgroup still busy is removed
later by a background thread. Before the removal a v1 memory cgroup is emptied (``memory.force_empty``): the
page cache a run's reads charged to it would otherwise keep it alive as a "dying" cgroup after ``rmdir``.

A worker that died (SIGKILL) leaves its folder behind: the next worker's start-up sweeps such folders, first
killing any process still in their run cgroups (``cgroup.kill`` on v2; on v1 each member through a process
descriptor, its membership checked again after the descriptor is opened, so a recycled pid is never hit), then
removing them. The worker's guardian (``reflow.envs.guardian``) ends its runs when it dies; the sweep is the
second line.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("reflow")

@dataclass(frozen=True)
class CgroupLayout:
    version: int
    """1 (separate memory and pids hierarchies) or 2 (unified)."""
    memory_parent: str
    """The folder run cgroups are made in, for the memory controller (v2: for both)."""
    pids_parent: str


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root of the hierarchy it shows, file system type, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], set(fields[separator + 3].split(","))
            if fstype in ("cgroup", "cgroup2"):
                out.append((fields[4], fields[3], fstype, options))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller, and "" for v2."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                out[controller] = path
    return out


def _folder(point: str, root: str, own: str) -> str:
    """This process's cgroup folder under a mount that shows the hierarchy from ``root`` (a container's
    mount often shows its own cgroup as the mount's top)."""
    if root != "/" and (own == root or own.startswith(root + "/")):
        own = own[len(root):]
    return os.path.join(point, own.lstrip("/"))


_detect_lock = threading.Lock()
_made: list[str] = []
"""Folders this process made at detection (removed at exit, innermost first)."""
_UNSET = object()
_detected: object = _UNSET


def _make(folder: str) -> None:
    os.mkdir(folder)
    _made.append(folder)


def _check_run(layout: "CgroupLayout") -> bool:
    """Make, limit and remove one run cgroup: what every run will do."""
    try:
        RunCgroup(layout, 64 << 20, 8).remove(wait_s=1.0)
        return True
    except OSError:
        return False


def detect() -> "CgroupLayout | None":
    """The per-run cgroup layout this host allows (checked once per process, under a lock), or None."""
    global _detected
    with _detect_lock:
        if _detected is _UNSET:
            _detected = _detect()
        return _detected


OWNER_LOCKS = "/run/reflow-sandbox"
"""Where each worker holds a lock for its cgroup folder while it lives (a temporary folder of its own user's
where /run is not writable)."""
_owner_lock: list[int] = []
"""The descriptor holding this process's lock (kept open, and locked, for the process's life)."""


def _locks_folder() -> str:
    for folder in (OWNER_LOCKS, os.path.join(tempfile.gettempdir(), f"reflow-sandbox-{os.geteuid()}")):
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.access(folder, os.W_OK) and os.stat(folder).st_uid == os.geteuid():
                return folder
        except OSError:
            continue
    raise OSError("no folder for the sandbox's owner locks")


def _hold_owner_lock(name: str) -> None:
    """Lock ``<locks>/<name>``: the folder ``name`` has a living owner while the lock is held. The folder's name
    is random, so that no host pid shows in a run's ``/proc/self/cgroup``."""
    fd = os.open(os.path.join(_locks_folder(), name), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _owner_lock.append(fd)


def _owner_gone(name: str) -> bool:
    """Whether the process that made the folder ``name`` is gone: its lock can be taken (or never existed)."""
    try:
        path = os.path.join(_locks_folder(), name)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner lives
    finally:
        os.close(fd)
    try:
        os.remove(path)
    except OSError:
        pass
    return True


def _sweep(folder: str) -> None:
    """Clear what processes that died without cleaning up (SIGKILL) left in ``folder``: their
    ``reflow-sandbox-<random>`` folders (owner lock free) and the run cgroups in them, processes and all."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[:2] != ["reflow", "sandbox"] or not _owner_gone(name):
            continue
        stale = os.path.join(folder, name)
        try:
            runs = [entry for entry in os.listdir(stale) if entry.startswith("run-")]
        except OSError:
            continue
        for run in runs:
            _kill_members(os.path.join(stale, run))
        for run in runs:
            _empty_and_remove(os.path.join(stale, run), 1.0)
        _remove_folder(stale)


def _kill_members(folder: str) -> None:
    """SIGKILL every process in the cgroup ``folder`` (a dead worker's run: the guardian missed it)."""
    kill_file = os.path.join(folder, "cgroup.kill")
    if os.path.exists(kill_file):  # v2: the kernel kills the whole cgroup, new forks included
        try:
            _write(kill_file, "1")
        except OSError:
            pass
        return
    for _ in range(100):  # v1: a member may fork while it is being killed; pids.max bounds how often
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                pids = [int(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return
        if not pids:
            return
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # exited
            try:
                if _in_cgroup(pid, folder):  # still the member listed, not a recycled pid elsewhere
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.01)


def _in_cgroup(pid: int, folder: str) -> bool:
    """Whether ``pid`` is in the cgroup ``folder`` (its path relative to the hierarchy's mount)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            paths = [line.rstrip("\n").split(":", 2)[2] for line in f]
    except OSError:
        return False
    return any(path != "/" and folder.endswith(path) for path in paths)


def _empty_and_remove(folder: str, seconds: float) -> bool:
    """Release the page cache a v1 memory cgroup holds, then remove it (waiting up to ``seconds``)."""
    force_empty = os.path.join(folder, "memory.force_empty")
    if os.path.exists(force_empty):
        try:
            _write(force_empty, "0")
        except OSError:
            pass  # busy still, or not allowed: rmdir leaves it dying, not leaked
    return not _remove_within([folder], seconds)


def _detect() -> "CgroupLayout | None":
    try:
        mounts, own = _mounts(), _own_paths()
    except (OSError, ValueError):
        return None
    name = f"reflow-sandbox-{uuid.uuid4().hex[:12]}"
    v1 = {
        controller: (point, root) for point, root, fstype, options in mounts if fstype == "cgroup"
        for controller in ("memory", "pids") if controller in options
    }
    if "memory" in v1 and "pids" in v1 and "memory" in own and "pids" in own:
        memory = os.path.join(_folder(*v1["memory"], own["memory"]), name)
        pids = os.path.join(_folder(*v1["pids"], own["pids"]), name)
        _sweep(os.path.dirname(memory))
        _sweep(os.path.dirname(pids))

        def separate_layout() -> CgroupLayout:
            _hold_owner_lock(name)
            _make(memory)
            _make(pids)
            return CgroupLayout(1, memory, pids)

        layout = _set_up(separate_layout)
        if layout is not None:
            return layout
    unified = next(((point, root) for point, root, fstype, _ in mounts if fstype == "cgroup2"), None)
    if unified is not None and "" in own:
        parent = os.path.join(_folder(*unified, own[""]), name)
        _sweep(os.path.dirname(parent))

        def unified_layout() -> CgroupLayout:
            # a v2 cgroup can give controllers to its children only if it holds no process itself: the folder
            # made here holds none, so it can, provided this process's cgroup gives it memory and pids
            if not _owner_lock:
                _hold_owner_lock(name)
            _make(parent)
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
            return CgroupLayout(2, parent, parent)

        return _set_up(unified_layout)
    return None


def _set_up(make: "Callable[[], CgroupLayout]") -> "CgroupLayout | None":
    """The layout ``make`` builds if a run cgroup works in it; else None, with what it made removed."""
    try:
        layout = make()
        if _check_run(layout):
            return layout
    except OSError:
        pass
    _remove_made()
    return None


def _remove_made() -> None:
    while _made:
        _remove_folder(_made.pop())


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _remove_folder(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


class RunCgroup:
    """One run's cgroup(s), made with their limits; ``attach`` the run's first processes, ``remove`` after."""

    def __init__(self, layout: CgroupLayout, memory_bytes: int, processes: int):
        self.layout = layout
        name = f"run-{uuid.uuid4().hex[:12]}"
        self.memory_dir = os.path.join(layout.memory_parent, name)
        self.pids_dir = os.path.join(layout.pids_parent, name)
        self.dirs = [self.memory_dir] if layout.version == 2 else [self.memory_dir, self.pids_dir]
        try:
            for folder in self.dirs:
                os.mkdir(folder)
            if layout.version == 1:
                _write(os.path.join(self.memory_dir, "memory.limit_in_bytes"), str(memory_bytes))
                swap = os.path.join(self.memory_dir, "memory.memsw.limit_in_bytes")
                if os.path.exists(swap):
                    _write(swap, str(memory_bytes))
                else:  # no swap accounting: keep the run's pages out of swap instead
                    _write(os.path.join(self.memory_dir, "memory.swappiness"), "0")
                _write(os.path.join(self.pids_dir, "pids.max"), str(processes))
            else:
                _write(os.path.join(self.memory_dir, "memory.max"), str(memory_bytes))
                swap = os.path.join(self.memory_dir, "memory.swap.max")
                if os.path.exists(swap):
                    _write(swap, "0")
                _write(os.path.join(self.memory_dir, "memory.oom.group"), "1")
                _write(os.path.join(self.memory_dir, "pids.max"), str(processes))
        except OSError:
            self.remove()
            raise

    def attach(self, pid: int) -> None:
        for folder in self.dirs:
            _write(os.path.join(folder, "cgroup.procs"), str(pid))

    def oom_kills(self) -> int:
        """Processes of the run the OOM killer ended (the kernel's count)."""
        name = "memory.oom_control" if self.layout.version == 1 else "memory.events"
        try:
            with open(os.path.join(self.memory_dir, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, wait_s: float = 0.5) -> None:
        """Remove the cgroup(s), waiting up to ``wait_s`` for the run's last processes to be released (they are
        dead: the teardown waited for the sandbox's init); ones still busy go to a background thread."""
        left = [folder for folder in self.dirs if not _empty_and_remove(folder, wait_s)]
        if left:
            with _pending_lock:
                _pending.extend(left)
            threading.Thread(target=_remove_pending, args=(30.0,), daemon=True, name="sandbox-cgroup-cleanup").start()


_pending: list[str] = []
_pending_lock = threading.Lock()


def _remove_within(folders: list[str], seconds: float) -> list[str]:
    until = time.time() + seconds
    folders = [folder for folder in folders if not _remove_folder(folder)]
    while folders and time.time() < until:
        time.sleep(0.01)
        folders = [folder for folder in folders if not _remove_folder(folder)]
    return folders


def _remove_pending(seconds: float) -> None:
    with _pending_lock:
        folders, _pending[:] = list(_pending), []
    left = _remove_within(folders, seconds)
    if left:
        logger.warning(f"sandbox: could not remove the run cgroups {left}")


@atexit.register
def _remove_everything() -> None:
    """At exit: the runs' cgroups still pending, then the folders made at detection."""
    _remove_pending(2.0)
    made = list(_made)
    _remove_made()
    if made and _owner_lock:  # the folder is gone: its lock file goes too
        try:
            os.remove(os.path.join(_locks_folder(), os.path.basename(made[0])))
        except OSError:
            pass
