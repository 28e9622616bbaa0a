"""The launcher inside a sandbox run (``reflow.envs.sandbox``): ``python -I launch.py HOOK EXIT_MEMORY LIMIT...``,
in the working directory that holds ``main.py`` (the code); stdin is the run's input.

Standard library only, and small modules only: a run pays every import before the code starts, and ``json``
and ``traceback`` (about 6 ms each with the ``re`` they load) were a third of a run's CPU. In the kernel
boundary it is copied in read-only and runs as the unprivileged sandbox user under the seccomp filter already;
it is not trusted for anything after the code starts, since the code runs in this same interpreter. Before the
code runs, in this order:

  1. the default scheduling policy and a nice value of at least 0 (a worker's real-time policy is inherited),
     then resource limits (``SandboxLimits.rlimits``), which an unprivileged process cannot raise again: CPU
     seconds (the kernel's SIGKILL at the limit), address space, file size (a write past it fails with
     EFBIG), open files, processes (counted in the run's own user namespace), POSIX message queues (none),
     no core dumps, no real-time priority or time, no lower nice value, 64 KiB locked, 64 queued signals
  2. (``audit_hook``) an audit hook, the third layer, which words refusals for the model: no network, no
     other programs, no ctypes, no signals to other processes, no files outside the working directory, /tmp
     and the installation (for reading). The kernel layers hold without it.
  3. the code, as ``__main__``; a MemoryError it does not catch ends the run with ``exit_memory`` (the
     parent's ``memory_limit``), after its traceback.
"""

import os
import resource
import signal
import sys


def _install_guard(workdir: str) -> None:
    import sysconfig

    read_roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix) if p}
    read_roots |= {os.path.realpath(p) for p in sysconfig.get_paths().values() if p}
    read_roots |= {os.path.realpath(p) for p in sys.path if p and os.path.isabs(p)}
    read_devices = {"/dev/null", "/dev/urandom", "/dev/random", "/dev/zero"}
    writable = {workdir, os.path.realpath(os.environ.get("TMPDIR", workdir))}
    me = os.getpid()

    def inside(path, roots) -> bool:
        real = os.path.realpath(path)
        return any(real == root or real.startswith(root + os.sep) for root in roots)

    def path_of(arg):
        if isinstance(arg, int):
            return None
        if isinstance(arg, bytes):
            arg = os.fsdecode(arg)
        return os.path.join(os.getcwd(), arg) if isinstance(arg, str) else None

    def refuse(what: str):
        raise PermissionError(f"sandbox: {what} is not allowed")

    writes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
              "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.mkfifo", "os.mknod"}
    programs = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"}

    def guard(event: str, args: tuple) -> None:
        if event == "open":
            path = path_of(args[0])
            if path is None:
                return
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writing = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
            if inside(path, writable):
                return
            if not writing and (os.path.realpath(path) in read_devices or inside(path, read_roots)):
                return
            refuse(f"{'writing' if writing else 'reading'} {args[0]!r} (outside the working directory)")
        elif event in writes:
            for arg in args[:2]:
                path = path_of(arg)
                if path is not None and not inside(path, writable):
                    refuse(f"{event} on {arg!r} (outside the working directory)")
        elif event.startswith("socket."):
            refuse("network access")
        elif event in programs:
            refuse(f"running another program ({event})")
        elif event.startswith("ctypes."):
            refuse("native code through ctypes")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill") and args and args[0] != me:
            refuse(f"signalling process {args[0]}")

    sys.addaudithook(guard)


def _ordinary_scheduling() -> None:
    """The default scheduling policy and a nice value of at least 0: a worker's real-time policy or raised
    priority is inherited across fork and exec, and lowering either is always allowed."""
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


def main() -> None:
    # argv: the audit hook (1 or 0), the exit code for a MemoryError, then RLIMIT_X=soft,hard per limit
    audit_hook, exit_memory, *rlimits = sys.argv[1:]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit fails with EFBIG instead
    _ordinary_scheduling()
    for limit in rlimits:  # ``SandboxLimits.rlimits``
        name, values = limit.split("=")
        soft, hard = values.split(",")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    sys.argv = ["main.py"]
    if audit_hook == "1":
        _install_guard(os.getcwd())
    try:
        code = compile(source, "main.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        sys.__excepthook__(*sys.exc_info())  # the interpreter's own printer: no import, with memory short
        sys.stderr.flush()
        os._exit(int(exit_memory))


if __name__ == "__main__":
    main()
