"""The inside of a sandbox run (``reflow.envs.sandbox``): started as ``python -I sandbox_child.py LIMITS_JSON``.

Standard library only, and nothing from the host's environment: the parent starts it with a scrubbed
environment, in the throwaway working directory that holds ``main.py`` (the code) and ``stdin.txt``.
Before the code runs, in this order:

  1. resource limits: CPU seconds, address space, file size, open files, processes, no core dumps;
  2. (host root only, when ``nobody`` can read this Python) drop to the unprivileged ``nobody`` user: the
     process-count limit applies to it (the kernel does not enforce it for root), files outside the working
     directory are not its own, and signals to the parent's processes fail with EPERM;
  3. an audit hook (PEP 578) that cannot be removed: no network calls, no running other programs, no
     loading native code through ctypes, no signals to other processes, no new processes at all when the
     child is still root (``refuse_processes``), and files may be opened, listed
     or changed only inside the working directory (reads may also reach Python's own installation, which
     imports need). A refused call raises PermissionError naming what was refused.

Under the parent's namespaces (``unshare``, when the host allows) the code also has no network devices
and its own PID space, so the parent's processes do not exist for it. The hook guards Python's own
calls (relative paths resolve against a current directory that never leaves the working directory, and
no folder outside it can be opened for a ``dir_fd``); native code it cannot see is kept out by refusing
ctypes and ``_posixsubprocess``.
"""

import json
import os
import resource
import signal
import sys


def _limit(name: str, value: int, hard: int | None = None) -> None:
    resource.setrlimit(getattr(resource, name), (value, value if hard is None else hard))


UNAUDITED = ("_posixsubprocess",)
"""Native modules that start programs without raising an audit event (subprocess's fork_exec)."""


def _install_guard(workdir: str, refuse_processes: bool) -> None:
    import sysconfig

    read_roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix) if p}
    read_roots |= {os.path.realpath(p) for p in sysconfig.get_paths().values() if p}
    read_roots |= {os.path.realpath(p) for p in sys.path if p and os.path.isabs(p)}
    read_devices = {"/dev/null", "/dev/urandom", "/dev/random"}
    me = os.getpid()

    def inside(path, roots) -> bool:
        real = os.path.realpath(path)
        return any(real == root or real.startswith(root + os.sep) for root in roots)

    def path_of(arg):
        if isinstance(arg, int):  # an open descriptor: already checked when it was opened
            return None
        if isinstance(arg, bytes):
            arg = os.fsdecode(arg)
        # a relative path is relative to the current directory, which never leaves the working directory
        # (os.chdir is refused outside it); a directory descriptor (dir_fd) can only be one of the working
        # directory's (opening a directory outside it is refused)
        return os.path.join(os.getcwd(), arg) if isinstance(arg, str) else None

    def refuse(what: str):
        raise PermissionError(f"sandbox: {what} is not allowed")

    writes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
              "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.chflags",
              "os.mkfifo", "os.mknod", "os.lchown", "os.lchmod"}
    programs = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn", "os.startfile"}

    def guard(event: str, args: tuple) -> None:
        if event == "open":
            path = path_of(args[0])
            if path is None:
                return
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writing = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
            if inside(path, {workdir}):
                return
            if not writing and os.path.isdir(path):
                refuse(f"opening the folder {args[0]!r} (outside the working directory)")
            if not writing and (os.path.realpath(path) in read_devices or inside(path, read_roots)):
                return
            refuse(f"{'writing' if writing else 'reading'} {args[0]!r} (outside the working directory)")
        elif event in writes:
            for arg in args[:2]:
                path = path_of(arg)
                if path is not None and not inside(path, {workdir}):
                    refuse(f"{event} on {arg!r} (outside the working directory)")
        elif event in ("os.listdir", "os.scandir"):  # imports list the installation's folders
            path = path_of(args[0] if args and args[0] is not None else ".")
            if path is not None and not inside(path, {workdir} | read_roots):
                refuse(f"{event} on {args[0]!r} (outside the working directory)")
        elif event in ("os.chdir", "os.fchdir", "os.chroot"):
            path = path_of(args[0] if args else None)
            if path is None or not inside(path, {workdir}):
                refuse(f"{event} to {args[0] if args else None!r} (outside the working directory)")
        elif event == "import" and args and args[0] in UNAUDITED:
            refuse(f"importing {args[0]} (it starts programs without an audit event)")
        elif event.startswith("socket."):
            refuse("network access")
        elif event in ("os.fork", "os.forkpty") and refuse_processes:
            refuse("starting a process (the sandbox runs as root here, where the kernel cannot count them)")
        elif event in programs:
            refuse(f"running another program ({event})")
        elif event.startswith("ctypes."):
            refuse("native code through ctypes")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill") and args and args[0] != me:
            refuse(f"signalling process {args[0]}")

    for name in [*UNAUDITED, "subprocess", "multiprocessing", "asyncio.subprocess"]:
        sys.modules.pop(name, None)  # a module already imported would not raise the import event again
    sys.addaudithook(guard)


def _on_cpu_limit(signum, frame):
    # the parent reads the status from this line: through ``unshare`` a child's signal does not survive
    os.write(2, b"\nsandbox: CPU time limit exceeded\n")
    os._exit(124)


def main() -> None:
    limits = json.loads(sys.argv[1])
    signal.signal(signal.SIGXCPU, _on_cpu_limit)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit raises EFBIG instead
    workdir = os.getcwd()
    _limit("RLIMIT_CORE", 0)
    cpu_s = max(1, int(limits["cpu_s"]))
    _limit("RLIMIT_CPU", cpu_s, cpu_s + 1)  # SIGXCPU at the soft limit (reported as cpu_limit), SIGKILL a second later
    _limit("RLIMIT_AS", int(limits["memory_mb"]) << 20)
    _limit("RLIMIT_FSIZE", int(limits["file_size_mb"]) << 20)
    _limit("RLIMIT_NOFILE", int(limits["open_files"]))
    if limits.get("drop_to_uid") is not None:
        os.setgroups([])
        os.setgid(limits["drop_to_gid"])
        os.setuid(limits["drop_to_uid"])
    _limit("RLIMIT_NPROC", int(limits["processes"]))
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.stdin = open("stdin.txt", encoding="utf-8")
    sys.argv = ["main.py"]
    _install_guard(workdir, bool(limits.get("refuse_processes")))
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
