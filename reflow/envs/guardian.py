"""A sandbox run never outlives the worker that started it: the guardian, one small process of ours per worker.

Why bwrap's ``--die-with-parent`` is not enough: it is a parent-death signal on the run's init, and the init is
the program (``--as-pid-1``), which can clear its own parent-death signal with an ordinary ``prctl``, no
capability needed. Killed by SIGKILL, or by the SIGTERM torchrun sends on a failure, the worker then leaves the
run going with nobody to end it.

The guardian is not in the run's reach: a separate process of the worker's user, outside the run's namespaces
(the program sees neither its pid nor its files, and may not use ptrace, pidfds or another process's limits:
``reflow.envs.seccomp``). Who waits for whom:

  1. the worker starts the guardian at its first run (``Guardian.get``), with one end of a SOCK_SEQPACKET
     socket pair, in a session of its own (a signal to the worker's process group does not reach it first)
  2. each run, before its program starts (the handshake's block byte comes after: ``reflow.envs.supervisor``):
     the worker sends ``+`` and the run's id with the run's process descriptors (the init's and bwrap's) as
     SCM_RIGHTS; the guardian keeps them. Its reply (one byte) is awaited, so the run cannot start unwatched
  3. the run's teardown: ``-`` and the id; the guardian closes those descriptors
  4. the worker dies, however: the kernel closes its end, the guardian reads end-of-file, sends SIGKILL to every
     run it still holds (through the descriptors: a recycled pid is never hit; the init's death takes its whole
     PID namespace) and exits. A SIGTERM, SIGINT or SIGHUP to the guardian itself does the same.

Why it neither leaks nor deadlocks: the guardian only ever blocks reading the socket; the worker blocks only on
the guardian's one-byte reply to ``+``, bounded by ``REPLY_TIMEOUT_S`` (a guardian that does not answer is
replaced, and the run is refused rather than started unwatched). A guardian that died (only the worker's user
could kill it) is noticed at the next send and replaced; the runs it held are then covered by their deadlines
and bwrap's die-with-parent only, and the replacement is logged.

The guardian is this file run as a script (``python -I guardian.py FD``): standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading

REPLY_TIMEOUT_S = 10.0
"""How long the worker waits for the guardian to confirm it holds a run's descriptors."""
MESSAGE = struct.Struct("=c16s")
"""b'+' or b'-', then the run's id (16 bytes)."""


class GuardianUnavailable(OSError):
    """The guardian could not be started or did not confirm a run: the run must not start."""


class Guardian:
    """The worker's side: ``watch`` a run before its program starts, ``forget`` it after its teardown."""

    _lock = threading.Lock()
    _instance: "Guardian | None" = None

    def __init__(self):
        import subprocess

        worker_end, guardian_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), str(guardian_end.fileno())],
                pass_fds=[guardian_end.fileno()], stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                env={"PATH": "/usr/bin:/bin"},
            )
        except OSError as error:
            worker_end.close()
            raise GuardianUnavailable(f"the sandbox's guardian did not start: {error}") from None
        finally:
            guardian_end.close()
        worker_end.settimeout(REPLY_TIMEOUT_S)
        self.socket = worker_end
        self.pid = os.getpid()
        self.send_lock = threading.Lock()

    @classmethod
    def get(cls) -> "Guardian":
        """This process's guardian, started at the first call (again after a fork, or if it died)."""
        with cls._lock:
            current = cls._instance
            if current is None or current.pid != os.getpid() or current.process.poll() is not None:
                if current is not None and current.pid == os.getpid():
                    import logging

                    logging.getLogger("reflow").warning("sandbox: the run guardian exited; starting a new one")
                    current.close()
                cls._instance = current = cls()
            return current

    def watch(self, run_id: bytes, fds: list[int]) -> None:
        """Hand the run's process descriptors to the guardian and wait for its confirmation."""
        with self.send_lock:
            try:
                socket.send_fds(self.socket, [MESSAGE.pack(b"+", run_id)], fds)
                reply = self.socket.recv(1)
            except OSError as error:
                raise GuardianUnavailable(f"the sandbox's guardian did not take the run: {error!r}") from None
        if reply != b"+":
            raise GuardianUnavailable(f"the sandbox's guardian did not take the run (replied {reply!r})")

    def forget(self, run_id: bytes) -> None:
        """The run is gone: the guardian closes its descriptors (never raises)."""
        with self.send_lock:
            try:
                self.socket.send(MESSAGE.pack(b"-", run_id))
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.socket.close()
        except OSError:
            pass


# ---- the guardian process ------------------------------------------------------------------------------


def _kill_all(held: dict[bytes, list[int]]) -> None:
    for fds in held.values():
        for fd in fds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass  # exited already


def _serve(fd: int) -> None:
    channel = socket.socket(fileno=fd)
    held: dict[bytes, list[int]] = {}

    def end(*_):
        _kill_all(held)
        os._exit(0)

    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), end)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(channel, MESSAGE.size, 8)
        except InterruptedError:
            continue
        except OSError:
            data, fds = b"", []
        if not data:  # the worker is gone
            end()
        kind, run_id = MESSAGE.unpack(data)
        if kind == b"+":
            held[run_id] = list(fds)
            channel.send(b"+")
        else:
            for held_fd in held.pop(run_id, []) + list(fds):
                os.close(held_fd)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
