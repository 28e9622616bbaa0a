"""Per-run control groups: the sandbox's bound on a run's total memory and process count, where the host lets
this process create cgroups (a writable cgroup v1 ``memory`` and ``pids`` hierarchy, or a cgroup v2 subtree
with both controllers delegated). Without one, the bounds are per process: RLIMIT_AS for each of at most
``processes`` processes, and the tmpfs sizes.

With one, each run gets a cgroup of its own under this process's, holding every process of the run (bwrap's two
are moved in while bwrap waits on ``--block-fd``, before the program is forked):

  memory   the run's ``memory_mb`` plus its tmpfs sizes, for the whole run, page cache and tmpfs pages
           (the working directory, /tmp, /dev/shm) included, and no swap; past it the kernel's OOM killer ends a process of the run, which
           the parent reads back as ``memory_limit`` from the cgroup's own OOM-kill count
  pids     ``processes`` for the whole run (a fork bomb stops there, whatever user the processes run as)

Removal (after the run's processes are gone) never raises and never blocks: a cgroup still busy is removed
later by a background thread.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("reflow")

_counter = itertools.count()


@dataclass(frozen=True)
class CgroupLayout:
    version: int
    """1 (separate memory and pids hierarchies) or 2 (unified)."""
    memory_parent: str
    """The folder run cgroups are made in, for the memory controller (v2: for both)."""
    pids_parent: str


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], set(fields[separator + 3].split(","))
            if fstype in ("cgroup", "cgroup2"):
                out.append((fields[4], fstype, options))
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


def _usable(parent: str) -> bool:
    """Whether this process can make (and remove) a cgroup in ``parent``."""
    probe = os.path.join(parent, f"reflow-probe-{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def detect() -> CgroupLayout | None:
    """The per-run cgroup layout this host allows (checked once per process), or None."""
    try:
        mounts, own = _mounts(), _own_paths()
    except (OSError, ValueError):
        return None
    name = f"reflow-sandbox-{os.getpid()}"
    v1 = {controller: point for point, fstype, options in mounts if fstype == "cgroup" for controller in ("memory", "pids") if controller in options}
    if "memory" in v1 and "pids" in v1 and "memory" in own and "pids" in own:
        memory = os.path.join(v1["memory"], own["memory"].lstrip("/"), name)
        pids = os.path.join(v1["pids"], own["pids"].lstrip("/"), name)
        if _usable(memory) and _usable(pids):
            atexit.register(_remove_folder, memory)
            atexit.register(_remove_folder, pids)
            return CgroupLayout(1, memory, pids)
        _remove_folder(memory), _remove_folder(pids)
    unified = next((point for point, fstype, _ in mounts if fstype == "cgroup2"), None)
    if unified is not None and "" in own:
        mine = os.path.join(unified, own[""].lstrip("/"))
        try:
            with open(os.path.join(mine, "cgroup.subtree_control")) as f:
                delegated = set(f.read().split())
        except OSError:
            delegated = set()
        # a v2 cgroup with processes of its own cannot enable controllers for children ("no internal
        # processes"): only a subtree delegated with memory and pids enabled already is usable
        if {"memory", "pids"} <= delegated and _usable(os.path.join(mine, name)):
            atexit.register(_remove_folder, os.path.join(mine, name))
            return CgroupLayout(2, os.path.join(mine, name), os.path.join(mine, name))
    return None


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
        name = f"run-{next(_counter)}"
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

    def remove(self) -> None:
        """Remove the cgroup(s); ones still busy (the run's last processes exiting) go in the background."""
        left = [folder for folder in self.dirs if not _remove_folder(folder)]
        if left:
            threading.Thread(target=_remove_later, args=(left,), daemon=True, name="sandbox-cgroup-cleanup").start()


def _remove_later(folders: list[str], seconds: float = 30.0) -> None:
    until = time.time() + seconds
    while folders and time.time() < until:
        time.sleep(0.05)
        folders = [folder for folder in folders if not _remove_folder(folder)]
    if folders:
        logger.warning(f"sandbox: could not remove the run cgroups {folders}")
