"""A finished rank ends without Python's finalization (``reflow.process_lifetime``), yet runs its exit hooks,
Python's and C's (vLLM unlinks its shared memory in one of C's), keeps what it printed and returns its code;
start-up's objects are frozen out of the collector's reach."""

import subprocess
import sys

from tests.conftest import ROOT

PROGRAM = """
import atexit, ctypes, gc, os, sys
from reflow.process_lifetime import exit_now, freeze_startup_objects

class Cycle:
    def __init__(self):
        self.me = self

Cycle()  # start-up garbage: collected before the freeze, never frozen
freeze_startup_objects()
print("frozen", gc.get_freeze_count() > 0, "garbage left", sum(type(o).__name__ == "Cycle" for o in gc.get_objects()))
C_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)(lambda status, arg: os.write(1, b"|C exit handler ran"))
ctypes.PyDLL(None).on_exit(C_HANDLER, None)
atexit.register(lambda: print("|Python exit hook ran", end=""))
print("buffered, unflushed", end="")
sys.stderr.write("to stderr")
exit_now(3)
print("never")
"""


def test_exit_now_runs_the_exit_hooks_flushes_and_returns_the_code():
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == [
        "frozen True garbage left 0", "buffered, unflushed|Python exit hook ran|C exit handler ran",
    ]
    assert done.stderr == "to stderr"
