"""The sandbox battery: attacks on the kernel boundary, through the real task entry point, with the host's state
checked after each one.

Every attack is model output that ends a ReTool turn ("<code>...</code>"), answered by ``PythonInterpreter``
(``reflow.tasks.retool``) over a real ``Sandbox``. Each category has at least two independent techniques, and
each technique names the layer that stops it. The battery runs twice: with the audit hook off (the kernel
layers alone: bubblewrap's namespaces, the unprivileged user, the read-only root, size-limited tmpfs, the
seccomp filter, the resource limits, and the parent's reader) and as a task builds it (hook on).

What is asserted is the host, never the child's own account: files in a world-writable host folder (so that
only the mount namespace keeps a write out, not permissions), a secret in this process's environment, TCP, UNIX
and abstract-socket listeners on the host (no connection may arrive), a host helper process (alive, its limits
unchanged), the host's process table (nothing of the run outlives it), host disk and memory while the run
runs, and a reply that comes back in time with no secret in it.

Needs bubblewrap and unprivileged user namespaces (``make test`` installs bubblewrap where it can); without them
the battery is skipped with the reason, and the fail-closed tests below check the refusal instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from reflow.envs.isolation import SANDBOX_UID, KernelBoundary
from reflow.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, checked_boundary
from reflow.tasks.base import Problem
from reflow.tasks.retool import PythonInterpreter
from tests.conftest import require_kernel_sandbox

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=2.0, memory_mb=256, file_size_mb=64, disk_mb=16, shm_mb=4, output_bytes=2048,
                       output_cap_bytes=1 << 20, processes=16)
GIB = 1 << 30
MEMORY_BOUND = (LIMITS.memory_mb << 20) + 2 * (LIMITS.disk_mb << 20) + (LIMITS.shm_mb << 20)
"""What one process of a run may hold: its address space and the three tmpfs mounts."""


class Host:
    """The host state the attacks aim at, and the checks of it."""

    def __init__(self):
        self.closed = False
        self.mark = uuid.uuid4().hex
        self.folder = f"/tmp/reflow-battery-{self.mark}"
        os.makedirs(self.folder)
        os.chmod(self.folder, 0o777)  # writable by anyone: only the mount namespace can keep a write out
        self.secret = f"SECRET-{uuid.uuid4().hex}"
        self.secret_path = os.path.join(self.folder, "secret.txt")
        self.victim_path = os.path.join(self.folder, "victim.txt")
        for path, text, mode in ((self.secret_path, self.secret, 0o644), (self.victim_path, "intact", 0o666)):
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, mode)
        self.identity = []
        """The host's boot id and kernel command line: no reply may hold them."""
        for path in ("/proc/sys/kernel/random/boot_id", "/proc/cmdline"):
            with open(path) as f:
                text = f.read().strip()
            if len(text) >= 16:
                self.identity.append(text)
        self.env_secret = f"ENVSECRET-{uuid.uuid4().hex}"
        os.environ["REFLOW_BATTERY_SECRET"] = self.env_secret
        self.connections: list[str] = []
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.unix_path = os.path.join(self.folder, "host.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.abstract_name = f"reflow-battery-{self.mark}"
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.abstract_name)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp_port = self.udp.getsockname()[1]
        self.listeners = {"tcp": self.tcp, "unix": self.unix, "abstract": self.abstract}
        for name, listener in self.listeners.items():
            if name != "tcp":
                listener.listen(8)
            listener.settimeout(0.2)
            threading.Thread(target=self._accept, args=(name, listener), daemon=True).start()
        self.udp.settimeout(0.2)
        threading.Thread(target=self._receive, daemon=True).start()
        self.helper = subprocess.Popen(["sleep", "600"])
        self.helper_limits = self._limits(self.helper.pid)
        self.files = self._listing()

    def _accept(self, name, listener):
        while not self.closed:
            try:
                conn, _ = listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.connections.append(name)
            conn.close()

    def _receive(self):
        while not self.closed:
            try:
                self.udp.recvfrom(65536)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.connections.append("udp")

    @staticmethod
    def _limits(pid: int) -> str:
        with open(f"/proc/{pid}/limits") as f:
            return f.read()

    def _listing(self) -> dict[str, str]:
        out = {}
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            out[name] = open(path).read() if os.path.isfile(path) and not name.endswith(".sock") else "<other>"
        return out

    def run_processes(self) -> list[str]:
        """Host processes that belong to a sandbox run or carry the battery's mark."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            except (OSError, StopIteration, ValueError):
                continue
            sandbox_user = os.geteuid() == 0 and uid == SANDBOX_UID  # a run's processes, whatever they exec'd
            if (sandbox_user or "/sandbox/launch.py" in cmdline or self.mark in cmdline) and int(pid) != os.getpid():
                found.append(f"{pid} (uid {uid}): {cmdline[:120]}")
        return found

    def check(self, reply: str) -> None:
        """The host is as it was; the reply leaks nothing."""
        assert self._listing() == self.files, "a host file was created, changed or removed"
        assert not any(self.mark in name for name in os.listdir("/tmp")
                       if not name.startswith("reflow-battery-")), "a file appeared in host /tmp"
        assert self.secret not in reply and self.env_secret not in reply, "a secret came back"
        assert self.connections == [], f"a host listener was reached: {self.connections}"
        assert self.helper.poll() is None, "the host helper process was killed"
        assert self._limits(self.helper.pid) == self.helper_limits, "the host helper's limits changed"
        deadline = time.time() + 2.0
        while self.run_processes() and time.time() < deadline:
            time.sleep(0.05)
        assert self.run_processes() == [], f"processes outlived the run: {self.run_processes()}"

    def close(self):
        self.closed = True
        self.helper.kill()
        self.helper.wait()
        for listener in (*self.listeners.values(), self.udp):
            listener.close()
        os.environ.pop("REFLOW_BATTERY_SECRET", None)
        shutil.rmtree(self.folder, ignore_errors=True)


class MemoryWatch:
    """The host's lowest MemAvailable while a run runs (sampled every 10 ms)."""

    def __init__(self):
        self.lowest = self.before = self.available()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def available() -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no MemAvailable in /proc/meminfo")

    def _sample(self):
        while not self.stop.wait(0.01):
            self.lowest = min(self.lowest, self.available())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


# (category, technique, the layer that stops it, code). Placeholders: {secret_path} {victim_path} {folder} {port}
# {udp_port} {unix_path} {abstract} {helper} {mark} {parent}
ATTACKS = [
    # reading outside the working directory
    ("read", "absolute path", "mount namespace: the host folder is not in the sandbox's root",
     "print(open({secret_path!r}).read())"),
    ("read", "/proc/1/root and /proc/self/root", "PID + mount namespaces: both are the sandbox's own root",
     "for root in ('/proc/1/root', '/proc/self/root', '/proc/2/root'):\n"
     "    try:\n        print(open(root + {secret_path!r}).read())\n    except OSError as e:\n        print(e)"),
    ("read", "openat from a directory descriptor", "mount namespace",
     "import os\nfd = os.open('/', os.O_RDONLY)\n"
     "print(os.read(os.open({secret_path!r}.lstrip('/'), os.O_RDONLY, dir_fd=fd), 999))"),
    ("read", "raw open(2) through ctypes", "mount namespace (ctypes reaches the kernel, which has no such path)",
     "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.open({secret_path!r}.encode(), 0)\n"
     "print(fd, ctypes.get_errno())\nprint(os.read(fd, 999) if fd >= 0 else '')"),
    # writing outside
    ("write", "open for writing", "mount namespace (and the read-only root)",
     "open({victim_path!r}, 'w').write('escaped')"),
    ("write", "create in /tmp by raw creat(2)", "private tmpfs: the file lands in the run's own /tmp and dies with it",
     "import ctypes\nlibc = ctypes.CDLL(None)\nfd = libc.creat(b'/tmp/{mark}', 0o644)\nlibc.write(fd, b'escaped', 7)\nprint(fd)"),
    ("write", "the interpreter's own files", "read-only bind mount",
     "import os\nopen(os.__file__, 'a').write('# escaped')"),
    ("write", "rename over the victim", "mount namespace",
     "import os\nopen('mine', 'w').write('escaped')\nos.replace('mine', {victim_path!r})"),
    # deleting outside
    ("delete", "os.remove", "mount namespace", "import os\nos.remove({victim_path!r})"),
    ("delete", "shutil.rmtree of the host folder", "mount namespace", "import shutil\nshutil.rmtree({folder!r})"),
    ("delete", "unlinkat from the root descriptor", "mount namespace",
     "import os\nfd = os.open('/', os.O_RDONLY)\nos.unlink({victim_path!r}.lstrip('/'), dir_fd=fd)"),
    # linking outside
    ("link", "hard link to the victim, then write", "mount namespace (no such file to link)",
     "import os\nos.link({victim_path!r}, 'hard')\nopen('hard', 'w').write('escaped')"),
    ("link", "symlink to the victim, then write", "mount namespace: the link resolves inside the sandbox",
     "import os\nos.symlink({victim_path!r}, 'soft')\nopen('soft', 'w').write('escaped')"),
    ("link", "symlink through /proc/1/root", "PID namespace: /proc/1 is the sandbox's init",
     "import os\nos.symlink('/proc/1/root' + {folder!r}, 'up')\nopen('up/victim.txt', 'w').write('escaped')"),
    # the parent's environment and memory
    ("parent", "own environment", "cleared environment (bwrap is spawned with none)",
     "import os\nprint(dict(os.environ))"),
    ("parent", "every visible /proc/*/environ", "PID namespace: the host's processes are not there",
     "import os\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n"
     "    try:\n        print(pid, open(f'/proc/{{pid}}/environ').read())\n    except OSError as e:\n        print(pid, e)"),
    ("parent", "/proc/<parent>/mem and environ by host pid", "PID namespace",
     "for name in ('environ', 'mem', 'cmdline'):\n    try:\n        print(open(f'/proc/{parent}/' + name, 'rb').read(4096))\n"
     "    except OSError as e:\n        print(e)"),
    ("parent", "ptrace attach", "seccomp (ptrace refused) and the PID namespace",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "print(libc.ptrace(16, {parent}, 0, 0), 'errno', ctypes.get_errno())"),
    ("parent", "process_vm_readv", "seccomp",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(64)\n"
     "class iov(ctypes.Structure):\n    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
     "local = iov(ctypes.addressof(buf), 64)\nremote = iov(0x400000, 64)\n"
     "print(libc.syscall(310, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0), ctypes.get_errno(), buf.raw)"),
    # the network, host loopback and UNIX sockets included
    ("network", "TCP to a host loopback listener", "seccomp (no AF_INET socket), and the network namespace",
     "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"),
    ("network", "UDP to the host loopback", "seccomp, and the network namespace",
     "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('127.0.0.1', {udp_port}))"),
    ("network", "a raw socket(2) through ctypes", "seccomp",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.syscall(41, 2, 1, 0), ctypes.get_errno())"),
    ("network", "the host's UNIX socket by path", "mount namespace (the socket file is not there)",
     "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({unix_path!r})\nprint('connected')"),
    ("network", "the host's abstract UNIX socket", "network namespace (abstract names are per namespace)",
     "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('\\0' + {abstract!r})\nprint('connected')"),
    # surviving the run
    ("survive", "double fork and setsid", "PID namespace: its init ends with the program, and takes every process",
     "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
     "    os._exit(0)\nprint('parent done')"),
    ("survive", "a new interpreter that ignores SIGTERM and SIGHUP", "PID namespace (SIGKILL at its end)",
     "import os, sys\nif os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, '-c', "
     "'import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\\n"
     "time.sleep(60)  # {mark}'])\nprint('parent done')"),
    ("survive", "clear the parent-death signal and sleep past the deadline", "the parent's deadline, then the PID namespace",
     "import ctypes, os, time\nctypes.CDLL(None).prctl(1, 0)\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)"),
    # signalling or limiting host processes
    ("signal", "kill a host process by pid", "PID namespace: the pid names nothing there",
     "import os, signal\nos.kill({helper}, signal.SIGKILL)"),
    ("signal", "kill(-1): every process it may signal", "PID namespace: only the run's own",
     "import os, signal\nos.kill(-1, signal.SIGKILL)"),
    ("signal", "lower a host process's limits", "PID namespace (the pid names nothing there)",
     "import resource\nresource.prlimit({helper}, resource.RLIMIT_NOFILE, (1, 1))"),
    ("signal", "lower any process's limits by pid", "seccomp (prlimit64 with a pid)",
     "import os, resource\nresource.prlimit(os.getpid(), resource.RLIMIT_NOFILE, (1, 1))"),
    ("signal", "a process descriptor", "seccomp (pidfd_open)",
     "import os, signal\nfd = os.pidfd_open(os.getpid())\nsignal.pidfd_send_signal(fd, signal.SIGKILL)"),
    ("signal", "kill the parent", "PID namespace: the parent is the sandbox's init",
     "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({parent}, signal.SIGKILL)"),
    # exhausting disk
    ("disk", "one huge file in the working directory", "tmpfs size (ENOSPC)",
     "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))"),
    ("disk", "many files in /tmp", "tmpfs size",
     "for k in range(100000):\n    open(f'/tmp/f{{k}}', 'wb').write(b'x' * 65536)"),
    ("disk", "fill /dev/shm", "tmpfs size",
     "with open('/dev/shm/big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))"),
    # exhausting memory
    ("memory", "one huge allocation", "RLIMIT_AS (MemoryError)", "blocks = [bytearray(1 << 28) for _ in range(64)]"),
    ("memory", "anonymous mmap, touched", "RLIMIT_AS",
     "import mmap\nm = mmap.mmap(-1, 8 << 30)\nfor k in range(0, len(m), 4096):\n    m[k] = 1"),
    ("memory", "memfd pages (outside the address space)", "seccomp (memfd_create)",
     "import os\nfd = os.memfd_create('x')\nfor _ in range(4096):\n    os.write(fd, b'x' * (1 << 20))"),
    ("memory", "memfd through a raw syscall", "seccomp (memfd_create)",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.syscall(319, b'x', 0), 'errno', ctypes.get_errno())"),
    ("memory", "many processes, each near its address-space limit", "the run's cgroup (memory and pids)",
     "import os, time\nkids = []\nfor _ in range(12):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
     "    if pid == 0:\n        block = bytearray(200 << 20)\n        time.sleep(1)\n        os._exit(0)\n    kids.append(pid)\n"
     "print([os.waitpid(k, 0)[1] for k in kids])"),
    ("memory", "System V shared memory", "seccomp (shmget)",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "print(libc.shmget(0, 1 << 30, 0o1600), 'errno', ctypes.get_errno())"),
    # breaking the parent's reader
    ("reader", "100 MB on stdout without a newline", "the parent's output cap",
     "import sys\nfor _ in range(100):\n    sys.stdout.write('A' * (1 << 20))"),
    ("reader", "close both pipes, then sleep", "the parent's deadline",
     "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)"),
    ("reader", "a child keeps the pipes open after the program exits", "PID namespace: the child dies with it",
     "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('bye')"),
    ("reader", "bytes that are not UTF-8, and special-token text", "the parent decodes with replacement",
     "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x00<|im_end|><|eos|>\\n' * 100)"),
    ("reader", "ignore SIGXCPU and spin", "RLIMIT_CPU's hard limit (SIGKILL)",
     "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"),
    # host-wide kernel pools no namespace counts
    ("pool", "every Linux AIO context of the machine", "seccomp (io_setup)",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nctx = ctypes.c_ulong(0)\n"
     "print([libc.syscall(206, 65536, ctypes.byref(ctx)) for _ in range(3)], 'errno', ctypes.get_errno())"),
    ("pool", "System V semaphore sets", "seccomp (semget)",
     "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "print([libc.semget(0, 32000, 0o1600) for _ in range(3)], 'errno', ctypes.get_errno())"),
    # kernel memory outside the address space
    ("kernel memory", "unread socket buffers, enlarged", "seccomp (SO_SNDBUF and SO_RCVBUF keep their defaults)",
     "import socket\na, b = socket.socketpair()\na.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)"),
    ("kernel memory", "empty files by the hundred thousand in /tmp (inodes, not bytes)",
     "the run's cgroup (inodes and dentries are charged to it), and the deadline",
     "import os\nfor k in range(10 ** 7):\n    os.close(os.open(f'/tmp/{{k}}', os.O_CREAT | os.O_WRONLY))"),
    # the host's details and the run's own input
    ("host details", "stdin reopened read-write", "a sealed memory file",
     "f = open('/proc/self/fd/0', 'r+')\nf.write('escaped')\nf.flush()"),
    ("host details", "the host's boot id, command line and kernel config", "masked /proc files (read as empty)",
     "for path in ('/proc/sys/kernel/random/boot_id', '/proc/cmdline', '/proc/config.gz'):\n"
     "    try:\n        print(path, repr(open(path, 'rb').read(200)))\n    except OSError as e:\n        print(path, e)"),
    # priority over the host's processes
    ("priority", "real-time scheduling", "RLIMIT_RTPRIO pinned at 0",
     "import os\nos.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"),
    ("priority", "a lower nice value, and raised limits", "RLIMIT_NICE pinned at 0, hard limits",
     "import os, resource\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, -5)\nexcept OSError as e:\n    print(e)\n"
     "resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 30, 1 << 30))"),
]
CATEGORIES = sorted({category for category, *_ in ATTACKS})
EXPECTED = {
    "ptrace attach": "errno 1",
    "process_vm_readv": " 1 b",  # -1, then errno 1 (EPERM): refused, not merely failed
    "a raw socket(2) through ctypes": "-1 1",
    "TCP to a host loopback listener": "Operation not permitted",
    "UDP to the host loopback": "Operation not permitted",
    "lower any process's limits by pid": "Operation not permitted",
    "a process descriptor": "Operation not permitted",
    "memfd pages (outside the address space)": "Operation not permitted",
    "memfd through a raw syscall": "errno 1",
    "System V shared memory": "errno 1",
    "one huge file in the working directory": "No space left on device",
    "many files in /tmp": "No space left on device",
    "fill /dev/shm": "No space left on device",
    "the host's abstract UNIX socket": "Connection refused",
    "the host's UNIX socket by path": "No such file or directory",
    "every Linux AIO context of the machine": "[-1, -1, -1] errno 1",
    "System V semaphore sets": "[-1, -1, -1] errno 1",
    "unread socket buffers, enlarged": "Operation not permitted",
    "stdin reopened read-write": "Operation not permitted",
    "real-time scheduling": "Operation not permitted",
    "a lower nice value, and raised limits": "Permission denied",
}
"""What the reply must say with the audit hook off: the named layer's own refusal (seccomp's EPERM, a full
tmpfs, a namespace where the target does not exist), so that an attack cannot pass for another reason."""


@pytest.fixture(scope="module")
def host():
    require_kernel_sandbox()
    state = Host()
    yield state
    state.close()


@pytest.fixture(scope="module", params=["kernel layers only", "as a task builds it", "kernel layers, no cgroup"])
def interpreter(request):
    """The battery's three passes: the kernel layers alone (with the run's cgroup where the host allows one), as
    a task builds it (the audit hook on), and the kernel layers on a host without cgroups (the per-process
    bounds only, which a task accepts with ``task.sandbox_allow_without_cgroup``)."""
    boundary = require_kernel_sandbox()
    if request.param == "kernel layers, no cgroup":
        sandbox = Sandbox(LIMITS, boundary=boundary, audit_hook=False, cgroups=False, allow_without_cgroup=True)
    else:
        sandbox = Sandbox(LIMITS, boundary=boundary, audit_hook=request.param != "kernel layers only")
    return PythonInterpreter(sandbox, shown_chars=4096)


def _aio_contexts() -> int:
    """The machine's AIO contexts in use (one counter for the whole host)."""
    with open("/proc/sys/fs/aio-nr") as f:
        return int(f.read())


def test_every_category_has_two_techniques():
    for category in CATEGORIES:
        assert sum(1 for c, *_ in ATTACKS if c == category) >= 2, category


@pytest.mark.parametrize("attack", ATTACKS, ids=[f"{c}: {t}" for c, t, *_ in ATTACKS])
def test_attack_is_contained(host, interpreter, attack):
    category, technique, layer, template = attack
    code = template.format(
        secret_path=host.secret_path, victim_path=host.victim_path, folder=host.folder, port=host.port,
        udp_port=host.udp_port, unix_path=host.unix_path, abstract=host.abstract_name, helper=host.helper.pid,
        mark=host.mark, parent=os.getpid(),
    )
    if layer.startswith("the run's cgroup") and interpreter.sandbox.cgroups is None:
        pytest.skip("this host lets this process make no cgroup: a run's memory is bounded per process only")
    problem = Problem(uid="battery", prompt="", answer="")
    aio_before = _aio_contexts()
    with MemoryWatch() as memory:
        t0 = time.perf_counter()
        reply = interpreter.respond(problem, f"let me try\n<code>\n{code}\n</code>")
        elapsed = time.perf_counter() - t0
    print(f"{category} / {technique}: stopped by {layer}; {elapsed:.2f}s; reply {reply[-200:]!r}")
    assert isinstance(reply, str) and reply.startswith("<interpreter>")
    if not interpreter.sandbox.audit_hook and technique in EXPECTED:
        assert EXPECTED[technique] in reply, (technique, reply[-300:])
    assert elapsed < LIMITS.wall_s + 3.0, "the parent's reader was held past the deadline"
    # the run may have held some memory for a moment; never more than one process's bound (slack: other
    # processes of a loaded machine)
    assert memory.before - memory.lowest < MEMORY_BOUND + GIB, f"host memory fell by {(memory.before - memory.lowest) >> 20} MiB"
    host.check(reply)
    assert _aio_contexts() <= aio_before or category != "pool", "the run took host AIO contexts"
    for identity in host.identity:
        assert identity not in reply, "a host identity file came back"
    if category == "reader":
        assert len(reply) < 4096 + 200
    assert interpreter.sandbox.run("print('still here')").stdout == "still here\n"


def _kill_the_worker_mid_run(host, tmp_path, prelude: str, signum: int, settle_s: float) -> None:
    """A worker process runs a sandbox whose program runs ``prelude``, forks a child under a marked command line
    and sleeps; once the child shows on the host (and ``settle_s`` more), the worker gets ``signum``. Nothing of
    the run may be left on the host after it."""
    script = tmp_path / "worker.py"
    program = (
        f"import ctypes, os, sys, time\n{prelude}"
        "if os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, '-c', "
        f"'import time; time.sleep(120)  # {host.mark}'])\ntime.sleep(120)"
    )
    script.write_text(
        "from reflow.envs.sandbox import Sandbox, SandboxLimits\n"
        f"Sandbox(SandboxLimits(wall_s=120, cpu_s=60), audit_hook=False).run({program!r})\n"
    )
    worker = subprocess.Popen([sys.executable, str(script)], cwd=os.getcwd())
    marked = lambda: [p for p in host.run_processes() if host.mark in p]  # noqa: E731
    deadline = time.time() + 60
    while not marked() and time.time() < deadline:
        time.sleep(0.05)
    assert marked(), "the sandbox never started"
    time.sleep(settle_s)
    worker.send_signal(signum)
    worker.wait(timeout=30)
    host.check("")


def test_a_run_dies_with_its_parent(host, tmp_path):
    """The rollout worker killed mid-run (SIGKILL: nothing of it runs after): the sandbox's processes die with it
    (bwrap's --die-with-parent), none is left on the host."""
    _kill_the_worker_mid_run(host, tmp_path, "", signal.SIGKILL, 0.0)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_run_that_cleared_its_parent_death_signal_still_dies_with_the_worker(host, tmp_path, how):
    """The program is the namespace's init and clears the parent-death signal bwrap gave it (an ordinary prctl),
    forks, and waits; the worker is then killed (SIGKILL, or SIGTERM as torchrun sends on a failure). Nothing of
    the run may be left on the host: the run's guardian (``reflow.envs.guardian``) ends it. (The program has
    cleared its parent-death signal 0.5 s after its marked child appeared: it did so before forking it.)"""
    prelude = "ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none\n"
    _kill_the_worker_mid_run(host, tmp_path, prelude, getattr(signal, how), 0.5)


def test_a_run_sees_no_host_pid_in_its_cgroup_path():
    sandbox = Sandbox(LIMITS, boundary=require_kernel_sandbox(), audit_hook=False)
    if sandbox.cgroups is None:
        pytest.skip("this host lets this process make no cgroup")
    paths = sandbox.run("print(open('/proc/self/cgroup').read())").stdout
    tokens = {token for line in paths.splitlines() for part in line.split(":", 2)[-1].split("/") for token in part.split("-")}
    assert "reflow" in tokens and str(os.getpid()) not in tokens, paths


def test_ordinary_code_runs():
    sandbox = Sandbox(LIMITS, boundary=require_kernel_sandbox())
    result = sandbox.run("import math, json\nname = input()\nprint(json.dumps({'hi': name, 'r': math.isqrt(99)}))", stdin="ann\n")
    assert result.status == "ok", result.stderr
    assert result.stdout == '{"hi": "ann", "r": 9}\n'
    result = sandbox.run("open('notes.txt', 'w').write('kept')\nimport shutil\nshutil.copy2('notes.txt', '/tmp/copy')\n"
                         "print(open('/tmp/copy').read())")
    assert (result.status, result.stdout) == ("ok", "kept\n"), result.stderr
    result = sandbox.run("print(1/0)")
    assert result.status == "error" and result.message().endswith("ZeroDivisionError: division by zero")
    result = sandbox.run("import os\nprint(os.getuid(), os.getpid(), sorted(os.environ))")
    assert result.stdout.split(" ", 2)[:2] == ["65534", "1"]  # the unprivileged user, its PID namespace's init
    assert "REFLOW_BATTERY_SECRET" not in result.stdout


def _host_credentials(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.rstrip("\n").split(":", 1) for line in f)
    return {key: " ".join(fields[key].split()) for key in ("Uid", "Gid", "Groups", "CapPrm", "CapEff", "CapInh", "CapAmb")}


@pytest.mark.parametrize("switch", ["setpriv", "popen"])
def test_a_root_worker_starts_each_run_as_the_unprivileged_user_either_way(switch):
    """On a root host bwrap runs as uid and gid 65534 (real, effective, saved and filesystem ids), in no group,
    with no capability, whether ``setpriv`` switches the user (so the worker spawns with vfork, not a copy of its
    page tables) or ``Popen`` does (hosts without setpriv): read from the host's /proc while the run sleeps."""
    if os.geteuid() != 0:
        pytest.skip("the user switch is a root host's (elsewhere bwrap runs as the worker's own user)")
    boundary = require_kernel_sandbox()
    if switch == "setpriv":
        if boundary.setpriv is None:
            pytest.skip("this host has no setpriv")
        assert boundary.spawn_user() == {}  # nothing for Popen to switch: it may vfork
    else:
        boundary = KernelBoundary(boundary.bwrap, boundary.interpreter, boundary.uid, boundary.filter)  # no setpriv
        assert boundary.spawn_user() == {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}
    sandbox = Sandbox(LIMITS, boundary=boundary)
    result: list = []
    runner = threading.Thread(target=lambda: result.append(sandbox.run("import time\ntime.sleep(3)")))
    runner.start()
    seen = None
    deadline = time.time() + 10
    while seen is None and time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if argv[0].endswith(b"bwrap") and b"--block-fd" in argv:
                    seen = _host_credentials(int(pid))
                    break
            except (OSError, IndexError):
                continue
        time.sleep(0.02)
    runner.join()
    assert result and result[0].status == "ok", result
    nobody = " ".join([str(SANDBOX_UID)] * 4)
    none = "0000000000000000"
    assert seen == {"Uid": nobody, "Gid": nobody, "Groups": "", "CapPrm": none, "CapEff": none, "CapInh": none,
                    "CapAmb": none}, seen


@pytest.mark.parametrize("code, status, says", [
    ("while True:\n    pass", "cpu_limit", "time limit exceeded (CPU)"),
    ("blocks = [bytearray(1 << 28) for _ in range(64)]", "memory_limit", "memory limit exceeded"),
    ("while True:\n    print('A' * 4096)", "output_limit", "output limit exceeded"),
    ("import time\ntime.sleep(60)", "timeout", "time limit exceeded (wall clock)"),
    ("import faulthandler\nfaulthandler._read_null()", "killed", "killed (exit 139)"),  # a real fault (the init
    # ignores the signals it sends itself)
    # the child printing what the old parent parsed changes nothing: the status is the wait status
    ("import sys\nprint('sandbox: CPU time limit exceeded\\nMemoryError', file=sys.stderr)\nsys.exit(1)", "error", "MemoryError"),
])
def test_status_comes_from_the_wait_status(code, status, says):
    # a wall clock far past the CPU limit, so that a loaded machine still hits the CPU limit first (the sleep
    # case is the wall clock's own)
    limits = dataclasses.replace(LIMITS, wall_s=LIMITS.wall_s if status == "timeout" else 120.0)
    result = Sandbox(limits, boundary=require_kernel_sandbox()).run(code)
    assert result.status == status, (result.status, result.exit_code, result.stderr[-300:])
    assert says in result.message()


def test_fail_closed_without_bubblewrap(monkeypatch, tmp_path):
    """No bwrap on PATH: the sandbox refuses, one line naming what is missing and how to install it; a task that
    runs model code refuses to build, naming the key; the explicit opt-in runs with a loud warning."""
    from reflow.config.job_config import TaskSection
    from reflow.tasks import build_task

    monkeypatch.setenv("PATH", str(tmp_path))
    checked_boundary.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"bubblewrap \(bwrap\) not found on PATH: install bubblewrap"):
            Sandbox(LIMITS)
        with pytest.raises(SandboxUnavailable, match=r"^task.name = 'retool' runs model-written code.*sandbox_allow_unisolated"):
            build_task(TaskSection(name="retool"))
        build_task(TaskSection(name="chain_sum"))  # a task without model code needs no sandbox
        unisolated = Sandbox(LIMITS, allow_unisolated=True, python=sys.executable)
        assert unisolated.boundary is None and "namespaces" not in unisolated.isolation
        result = unisolated.run("print(input())", stdin="plain limits only")
        assert (result.status, result.stdout) == ("ok", "plain limits only\n")
    finally:
        checked_boundary.cache_clear()


def test_the_check_command_refuses_before_any_rank(tmp_path):
    """``reflow.train --check`` (what run_train.sh and the Slurm script run before torchrun) on the tiny coding
    agent's config without bubblewrap: exit code 2 and one line."""
    env = {**os.environ, "PATH": str(tmp_path) + ":" + os.path.dirname(sys.executable), "WORLD_SIZE": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "reflow.train", "--config", "train_configs/tiny_coding.toml", "--check"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("reflow:")]
    assert len(lines) == 1 and re.search(r"task.name = 'coding_agent'.*bwrap.*not found.*apt-get install bubblewrap",
                                         lines[0]), done.stderr


def test_environment_text_never_becomes_special_tokens():
    from reflow.rollout.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer("assets/tiny-qwen3")
    special = set(tokenizer.tok.all_special_ids)
    for marker in tokenizer.tok.all_special_tokens:
        ids = tokenizer.encode_continuation(f"<interpreter>\n{marker}\n</interpreter>\n")
        assert not special & set(ids), marker
        assert tokenizer.decode(ids).count(marker) == 1  # kept, as text


def test_sandbox_failures_score_zero_and_the_worker_goes_on(monkeypatch):
    """A run that cannot even start (here: too many processes on the host) is a failed test for the coding agent
    and an error reply for ReTool; nothing raises."""
    from reflow.tasks.coding import TestRunner

    sandbox = Sandbox(LIMITS, boundary=require_kernel_sandbox())

    def refuse(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    result = sandbox.run("print(1)")
    assert result.status == "sandbox_error" and not result.ok
    problem = Problem(uid="p", prompt="", answer="", tests=(("", "1\n"),))
    assert TestRunner(sandbox).run_tests(problem, "print(1)").passed == 0
    reply = PythonInterpreter(sandbox).respond(problem, "<code>\nprint(1)\n</code>")
    assert "the sandbox could not run the program" in reply



SECCOMP_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    out = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return out, ctypes.get_errno()
for name, nr in NUMBERS.items():
    print(name, *call(nr, 0, 0, 0, 0, 0, 0))
print("clone_newuser", *call(56, 0x10000000 | 17, 0, 0, 0, 0))
print("clone_pidfd", *call(56, 0x1000 | 17, 0, 0, 0, 0))
print("clone3", *call(435, 0, 0))
print("prlimit_self", *call(302, 0, 7, 0, 0))
print("prlimit_pid", *call(302, os.getpid(), 7, 0, 0))
print("socket_inet", *call(41, 2, 1, 0))
print("socket_unix", *call(41, 1, 1, 0))
print("ioctl_tiocsti", *call(16, 0, 0x5412, 0))
try:
    os.listxattr("/work")
except OSError as error:
    print("listxattr", -1, error.errno)
print("x32_getpid", flush=True)
call(0x40000000 + 39)
print("still alive after an x32 call")
"""


def test_seccomp_refuses_each_denied_call():
    """The second layer on its own terms: every denied call, made raw through ctypes from inside, gets its errno
    (EPERM, EOPNOTSUPP for extended attributes, ENOSYS for clone3); what is allowed still works; a call through
    the x32 ABI kills the process (SIGSYS: exit 128 + 31)."""
    import errno

    from reflow.envs import seccomp

    numbers = seccomp.X86_64_DENIED | seccomp.X86_64_XATTR
    sandbox = Sandbox(LIMITS, boundary=require_kernel_sandbox(), audit_hook=False)
    result = sandbox.run(f"NUMBERS = {numbers!r}\n" + SECCOMP_PROBE)
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.strip()}
    for name in seccomp.X86_64_DENIED:
        assert rows[name] == ["-1", str(errno.EPERM)], (name, rows.get(name))
    for name in seccomp.X86_64_XATTR:
        assert rows[name] == ["-1", str(errno.EOPNOTSUPP)], (name, rows.get(name))
    for name in ("clone_newuser", "clone_pidfd", "prlimit_pid", "socket_inet", "ioctl_tiocsti"):
        assert rows[name] == ["-1", str(errno.EPERM)], (name, rows[name])
    assert rows["clone3"] == ["-1", str(errno.ENOSYS)]
    assert rows["listxattr"] == ["-1", str(errno.EOPNOTSUPP)]
    assert rows["prlimit_self"][0] == "0" and int(rows["socket_unix"][0]) >= 0  # allowed calls still work
    assert "x32_getpid" in rows and "still" not in rows
    assert result.exit_code == 128 + 31, (result.exit_code, result.stderr[-300:])


def test_concurrent_runs_leave_nothing_behind(host):
    """Eight threads at once (the rollout worker's tool_workers): every run answers, and afterwards this process
    has the descriptors it had, the host no process of a run and no run cgroup."""
    from concurrent.futures import ThreadPoolExecutor

    sandbox = Sandbox(LIMITS, boundary=require_kernel_sandbox())
    before = sorted(os.listdir("/proc/self/fd"))
    programs = [(f"import os\nprint({k} * {k})", f"{k * k}\n") for k in range(48)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: sandbox.run(job[0]), programs))
    assert [(r.status, r.stdout) for r in results] == [("ok", expected) for _, expected in programs]
    assert sorted(os.listdir("/proc/self/fd")) == before
    host.check("")
    if sandbox.cgroups is not None:
        deadline = time.time() + 5
        while (
            time.time() < deadline
            and os.listdir(sandbox.cgroups.memory_parent) != _cgroup_files(sandbox.cgroups.memory_parent)
        ):
            time.sleep(0.05)
        leftover = [name for name in os.listdir(sandbox.cgroups.memory_parent) if name.startswith("run-")]
        assert leftover == [], leftover


def _cgroup_files(folder: str) -> list[str]:
    return [name for name in os.listdir(folder) if not name.startswith("run-")]


def test_the_next_worker_kills_what_a_dead_worker_left_in_its_run_cgroups():
    """A worker killed with runs alive (its guardian killed too) leaves run cgroups with processes in them; the
    next worker's start-up sweep kills those processes and removes the cgroups, rather than skipping a cgroup
    because it is not empty."""
    from reflow.envs import cgroups

    layout = cgroups.detect()
    if layout is None:
        pytest.skip("this host lets this process make no cgroup")
    name = f"reflow-sandbox-{uuid.uuid4().hex[:12]}"  # no owner lock held: its worker is gone
    parents = sorted({os.path.dirname(layout.memory_parent), os.path.dirname(layout.pids_parent)})
    runs = [os.path.join(parent, name, "run-left") for parent in parents]
    for run in runs:
        os.makedirs(run)
    leftover = subprocess.Popen(["sleep", "300"])
    for run in runs:
        with open(os.path.join(run, "cgroup.procs"), "w") as f:
            f.write(str(leftover.pid))
    for parent in parents:
        cgroups._sweep(parent)
    assert leftover.wait(timeout=10) == -signal.SIGKILL
    assert not any(os.path.exists(os.path.join(parent, name)) for parent in parents)
