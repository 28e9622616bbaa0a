"""A rank's start-up and exit, kept short: neither does work the run needs.

    freeze_startup_objects()     after the imports and the builds: later collections skip what start-up made
    exit_now(code)               the exit hooks, the streams flushed, then the process ends

Start-up: importing torch, torchtitan, transformers and vLLM makes about 630,000 Python objects that live as
long as the rank. Every full collection walks them all: vLLM's engine build collects five times (1.0 s of a
2.7 s build for the tiny model on this machine), its sleep and wake collect again, and Python's own full
collections during training walk them too. ``gc.freeze`` moves them to a permanent generation that
collections skip. It runs after one collection, so that no garbage of start-up is frozen with them (frozen
garbage would never be freed).

Exit: once ``reflow.train.main`` returns, every file the run writes is closed and every rank has passed the
final barrier. Python's own finalization then tears down each module and object of a process that is about
to end anyway: 2.5 s per rank for the tiny model, as long as a training step. ``exit_now`` runs the exit hooks
(``atexit``: vLLM's process-group teardown, the sandbox's cgroup cleanup), flushes stdout and stderr and ends
the process with C's ``exit``, not ``os._exit``: the C and C++ exit handlers must still run. vLLM's CPU engine
unlinks its tensor-parallel shared memory (``/dev/shm/*-cpushm_*``, one fixed name per rank group) in one;
after an ``os._exit`` those segments outlived the run, and the next tensor-parallel engine on the host failed
to start ("create shm in SHMManager failed. errno: 17"). It is called through ``ctypes.PyDLL``, which keeps
the GIL: handlers that reach into Python need it. A rank that fails raises out of ``main`` and is torn down in
full, as before.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import sys


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now out of the collector's reach (module docstring)."""
    gc.collect()
    gc.freeze()


def exit_now(code: int) -> None:
    """End this process with ``code`` without Python's finalization (module docstring); never returns."""
    try:
        atexit._run_exitfuncs()  # (logging's own shutdown among them)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing left to flush
                pass
        ctypes.PyDLL(None).exit(code)  # (module docstring: C's exit, with the GIL)
