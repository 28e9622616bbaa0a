"""Math answers scored with math-verify, in a child process under a hard timeout.

math-verify (Hugging Face) extracts the answer a completion gives (``\\boxed{...}`` first, then other LaTeX
or plain expressions), parses it and the reference into SymPy, and checks that they are equivalent
(``1/2``, ``0.5`` and ``\\frac{1}{2}`` agree). SymPy can take minutes on a pathological expression (a tower of
exponents, a huge factorial) that a policy may well write. math-verify's own timeouts use SIGALRM, which only
interrupts Python between bytecodes of the main thread, so the verifier runs in a child process instead:
a call that passes ``timeout_s`` kills it, counts a timeout, scores 0, and the next call starts a new child.
A rollout worker therefore never waits longer than ``timeout_s`` for a reward, whatever the completion.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from multiprocessing.connection import Connection


def _serve(conn: Connection) -> None:
    """The child: (completion, reference) in, 1.0 or 0.0 out, until the pipe closes."""
    from math_verify import parse, verify

    conn.send("ready")
    while True:
        try:
            completion, reference = conn.recv()
        except EOFError:
            return
        try:
            gold = parse(reference if "\\boxed" in reference or "$" in reference else f"\\boxed{{{reference}}}")
            answer = parse(completion)
            conn.send(1.0 if gold and answer and verify(gold, answer) else 0.0)
        except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer, never a crashed worker
            conn.send(0.0)


class MathVerifier:
    """``score(completion, reference)``: 1.0 when the completion's answer is equivalent to the reference."""

    START_TIMEOUT_S = 120.0
    """How long a new child may take to import math-verify (SymPy) on a loaded host; not the scoring budget."""

    def __init__(self, timeout_s: float = 5.0):
        if timeout_s <= 0:
            raise ValueError(f"the math-verify timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.timeouts = 0
        """Calls that passed the timeout (each scored 0)."""
        self._context = mp.get_context("spawn")  # no fork of a process holding torch, vLLM and process groups
        self._process = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child,), daemon=True, name="reflow-math-verify")
        self._process.start()
        child.close()
        self._conn = parent
        # the timeout bounds scoring, not the child's start: wait for it to be ready (a spawn re-imports
        # the parent's main module, which can take seconds on a host busy with ranks)
        if not parent.poll(self.START_TIMEOUT_S) or parent.recv() != "ready":
            self.close()
            raise RuntimeError(f"the math-verify child process did not start within {self.START_TIMEOUT_S:.0f} s")

    def score(self, completion: str, reference: str) -> float:
        with self._lock:  # one child, one pipe: callers on several threads (multi-turn scoring) take turns
            return self._score(completion, reference)

    def _score(self, completion: str, reference: str) -> float:
        try:
            return self._ask(completion, reference)
        except (EOFError, OSError):  # the child died (killed from outside, out of memory): start again once
            self.close()
        try:
            return self._ask(completion, reference)
        except (EOFError, OSError) as e:
            self.close()
            raise RuntimeError(f"the math-verify child process died twice in a row ({e!r})") from None

    def _ask(self, completion: str, reference: str) -> float:
        if self._process is None or not self._process.is_alive():
            self._start()
        self._conn.send((completion, reference))
        if self._conn.poll(self.timeout_s):
            return float(self._conn.recv())
        self.timeouts += 1
        self.close()  # the child is stuck in SymPy: kill it; the next call starts a new one
        return 0.0

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
            self._conn.close()
        self._process, self._conn = None, None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def boxed_reward(verifier: MathVerifier, text: str, reference: str) -> float:
    """1.0 when ``text`` has a ``\\boxed{}`` answer that math-verify finds equivalent to ``reference``; 0.0 without
    one (where the format is part of what is learned: math-verify would otherwise fall back to the last number)."""
    if "\\boxed{" not in text:
        return 0.0
    return verifier.score(text, reference)


def boxed_format_reward(problem, text: str) -> float:
    """1.0 when the response gives its answer in ``\\boxed{...}`` (right or wrong): a format reward
    (``reward.functions = ["task", "boxed"]``)."""
    return 1.0 if "\\boxed{" in text else 0.0
