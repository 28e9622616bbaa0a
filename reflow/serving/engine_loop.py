"""One thread owns a rollout engine and serves requests from any other thread.

    loop = EngineLoop(engine)
    future = loop.submit(request)      # any thread; a concurrent.futures.Future of the finished Request
    loop.close()

The engine is not thread-safe, so only the loop's thread touches it: between two engine steps it takes every
request submitted meanwhile, then steps while anything is in flight, and hands each finished request to its
future; with nothing in flight it blocks on its inbox. A request the engine refuses (``add`` raises) fails
its own future and nothing else. A request whose future was cancelled before the loop took it never reaches
the engine; one cancelled while it generates runs to its end and is dropped (its tokens are bounded by its
max_tokens). Every future resolves: if a step raises, every request in flight and every later one gets the
error; ``close`` fails what is in flight or queued.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from reflow.rollout.protocols import Engine
from reflow.rollout.request import Request


class EngineLoopClosed(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "reflow-engine-loop"):
        self.engine = engine
        self.inbox: queue.Queue[tuple[Request, Future] | None] = queue.Queue()
        self.waiting: dict[str, Future] = {}
        """Futures of the requests in the engine, by request id."""
        self.error: BaseException | None = None
        self.closed = False
        self.lock = threading.Lock()
        """Orders ``submit`` against the loop's end (an error or ``close``): a request is queued before it, or
        refused."""
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> Future:
        """Queue ``request`` (its id unique among those in flight); the future resolves to it, finished."""
        future: Future = Future()
        with self.lock:
            if self.error is not None:
                raise RuntimeError(f"the engine loop failed: {self.error!r}") from self.error
            if self.closed:
                raise EngineLoopClosed("the engine loop is closed")
            self.inbox.put((request, future))
        return future

    def close(self) -> None:
        """Stop taking requests; the thread ends after its current step, failing what is in flight or queued."""
        with self.lock:
            self.closed = True
            self.inbox.put(None)
        self.thread.join()

    def _take(self, block: bool) -> tuple[list[tuple[Request, Future]], bool]:
        """Every submission waiting (blocking for the first one when ``block``), and whether the loop is closed."""
        items = []
        try:
            item = self.inbox.get(block=block)
            while True:
                if item is None:
                    return items, True
                items.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return items, False

    def _start(self, request: Request, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before it started
        if request.request_id in self.waiting:
            future.set_exception(ValueError(f"request id {request.request_id!r} is in flight already"))
            return
        try:
            self.engine.add(request)
        except Exception as refused:  # (vLLM's checks of this request: its own error, the loop goes on)
            future.set_exception(refused)
            return
        self.waiting[request.request_id] = future

    def _run(self) -> None:
        ending: BaseException = EngineLoopClosed("the engine loop closed")
        try:
            while True:
                taken, closed = self._take(block=not self.engine.num_active)
                for request, future in taken:
                    if closed:
                        if future.set_running_or_notify_cancel():
                            future.set_exception(ending)
                    else:
                        self._start(request, future)
                if closed:
                    break
                if self.engine.num_active:
                    for request in self.engine.step():
                        future = self.waiting.pop(request.request_id, None)
                        if future is not None:
                            future.set_result(request)
        except BaseException as error:  # surfaced on every waiting future and every later submit
            ending = error
            with self.lock:
                self.error = error
        for future in self.waiting.values():
            future.set_exception(ending)
        self.waiting.clear()
        while True:  # whatever was queued before the loop ended
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(ending)
