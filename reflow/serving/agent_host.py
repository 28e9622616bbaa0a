"""The agents' process: a rank's endpoint server and its agents' event loop, apart from the process that owns the
engine.

    host = AgentHost.start(task, tokenizer, "tiny-tools", rollout)   # spawns the process; returns once it serves
    host.register(route, driver)          # the driver that gets the episode's calls and its agent's end
    host.start_episode(route, row)        # run the agent of one episode
    host.deliver(timeout_s)               # what the process sent, handed to each episode's driver
    host.answer(call_id, completions)     # a call's turn ended; or host.refuse(call_id, error)
    host.end_episode(route)               # cancel its agent (if it runs), refuse its call, forget its route
    host.close()

Why a process: an agent's call costs CPU outside the model (the ``openai`` client building the request, the HTTP
server parsing it, JSON both ways, the chat template). In the engine's process every such microsecond holds the
interpreter lock the engine's own loop needs between steps, and a run with agents generated about half as fast
as the built-in driver on the same task. Here the server and the agents share one event loop in a process of
their own, as vLLM's API server runs apart from its engine core.

The protocol (typed messages over one duplex pipe; who waits for whom):
  - the engine's side sends ``StartEpisode``, ``Answer``, ``Refuse``, ``EndEpisode`` and ``Shutdown``; it never
    waits on the agents' side except in ``deliver`` (bounded by its timeout) and at start-up (``Ready``);
  - the agents' side sends ``CallMade`` (a parsed, checked call) and ``AgentEnded`` (its return, or its failure's
    cause) from a sender thread, and reads on a reader thread that hands each message to the event loop: its loop
    never blocks on the pipe, and what the engine's side sends is always read, so neither side can wait on the
    other's full buffer while the other waits on its own;
  - a call waits on its future in the agents' loop; ``Answer`` or ``Refuse`` resolves it, ``EndEpisode`` refuses
    it, and a call for a route that is not live is refused at once (404), without a round trip;
  - the engine's side closing the pipe (a stop, a crash, ``os._exit``) ends the agents' process; the agents'
    process ending unasked is an error at the next ``deliver``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import signal
import ssl
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

from reflow.serving.openai_api import Call, Completion, OpenAIError

if TYPE_CHECKING:
    from reflow.config.job_config import RolloutSection
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.tasks.agent import AgentTask

STARTING_AT_ONCE = 16
"""Agents started and yet to make their first call, at most; the rest of the episodes wait their turn to start.
One event loop runs every agent in turn: started all at once, a step's hundreds of agents would each build and
send their first request before the first of them reached the engine (a quarter of a second of the engine idle
at the start of each step, measured with 256), where 16 at a time let the engine start within milliseconds and
the later agents start while it generates. An agent slow to make its first call holds a place until it calls or
ends (at most ``task.agent_timeout_s``)."""

START_TIMEOUT_S = 180.0
"""The agents' process imports the server, the tokenizer and the agent's module before it serves."""


# ---- messages ------------------------------------------------------------------------------------------------


@dataclass
class HostSettings:
    """What the agents' process is built from (picklable: it is spawned)."""

    agent: str
    agent_timeout_s: float
    max_turns: int
    hf_dir: str
    chat: bool
    name: str
    max_model_len: int
    temperature: float
    top_p: float
    host: str = "127.0.0.1"
    port: int = 0


@dataclass
class Ready:
    base_url: str
    """The server's root (an episode's client has ``{base_url}/episodes/<route>/v1``)."""
    api_key: str


@dataclass
class StartFailed:
    message: str


@dataclass
class StartEpisode:
    route: str
    row: dict


@dataclass
class CallMade:
    call_id: int
    route: str
    call: Call


@dataclass
class Answer:
    call_id: int
    completions: list[Completion]


@dataclass
class Refusal:
    """An ``OpenAIError`` as a message (an exception with its own constructor does not pickle)."""

    status: int
    message: str
    param: str | None
    code: str | None
    kind: str

    @classmethod
    def of(cls, error: OpenAIError) -> "Refusal":
        return cls(error.status, error.message, error.param, error.code, error.kind)

    def error(self) -> OpenAIError:
        return OpenAIError(self.status, self.message, self.param, self.code, self.kind)


@dataclass
class Refuse:
    call_id: int
    refusal: Refusal


@dataclass
class EndEpisode:
    route: str


@dataclass
class AgentEnded:
    route: str
    value: Any = None
    """The agent's return (a number or a dict), when it returned one of those."""
    failure: str | None = None
    """Else why it ended: "error", "timeout" or "bad_reward" (a return that is neither)."""
    detail: str = ""


@dataclass
class Shutdown:
    pass


# ---- the engine's side ---------------------------------------------------------------------------------------


class AgentHost:
    """The engine process's handle on its agents' process. One per rank, shared by its drivers (the run's, the
    evaluation's): each episode's messages go to the driver that registered its route."""

    def __init__(self, settings: HostSettings):
        self.settings = settings
        self.name = settings.name
        context = mp.get_context("spawn")  # no fork of a process holding torch, vLLM and process groups
        self.conn, child = context.Pipe(duplex=True)
        # (not a daemon: the agents' rewards may start processes of their own, e.g. math-verify's)
        self.process = context.Process(target=_agents_main, args=(child, settings), name="reflow-agents")
        self.process.start()
        child.close()
        self.drivers: dict[str, Any] = {}
        """Each live episode's driver, by route."""
        self.send_lock, self.receive_lock = threading.Lock(), threading.Lock()
        self.base_url = self.api_key = ""
        self.closed = False
        atexit.register(self.close)  # (before multiprocessing's own exit joins the process)

    @classmethod
    def start(cls, task: "AgentTask", tokenizer: "PromptTokenizer", name: str, rollout: "RolloutSection",
              host: str = "127.0.0.1", port: int = 0) -> "AgentHost":
        agents = cls(HostSettings(task.spec, task.timeout_s, task.max_turns, tokenizer.hf_dir, tokenizer.chat, name,
                                  rollout.max_model_len, rollout.temperature, rollout.top_p, host, port))
        if not agents.conn.poll(START_TIMEOUT_S):
            agents.close()
            raise RuntimeError(f"the agents' process did not start serving within {START_TIMEOUT_S:.0f}s")
        try:
            first = agents.conn.recv()
        except EOFError:
            agents.process.join(timeout=10)
            raise RuntimeError(f"the agents' process exited at start (exit code {agents.process.exitcode}); its "
                               "error is above") from None
        if isinstance(first, StartFailed):
            agents.close()
            raise RuntimeError(f"the agents' process could not start: {first.message}")
        agents.base_url, agents.api_key = first.base_url, first.api_key
        return agents

    def episode_url(self, route: str) -> str:
        return f"{self.base_url}/episodes/{route}/v1"

    def register(self, route: str, driver) -> None:
        self.drivers[route] = driver

    def start_episode(self, route: str, row: dict) -> None:
        self._send(StartEpisode(route, row))

    def answer(self, call_id: int, completions: list[Completion]) -> None:
        self._send(Answer(call_id, completions))

    def refuse(self, call_id: int, error: OpenAIError) -> None:
        self._send(Refuse(call_id, Refusal.of(error)))

    def end_episode(self, route: str) -> None:
        self.drivers.pop(route, None)
        self._send(EndEpisode(route))

    def deliver(self, timeout_s: float = 0.0) -> bool:
        """Hand every message the agents' process sent to its episode's driver (``driver.receive``), waiting up
        to ``timeout_s`` for the first; whether any came. A message for an ended episode is dropped (its call
        refused)."""
        got = False
        with self.receive_lock:
            wait = timeout_s
            while self._poll(wait):
                message = self.conn.recv()
                wait, got = 0.0, True
                driver = self.drivers.get(message.route)
                if driver is not None:
                    driver.receive(message)
                elif isinstance(message, CallMade):
                    self.refuse(message.call_id, OpenAIError(404, f"no episode {message.route!r} in flight", None,
                                                             "episode_not_found"))
        return got

    def _poll(self, timeout_s: float) -> bool:
        try:
            return self.conn.poll(timeout_s)
        except (EOFError, OSError):
            self._died()

    def _send(self, message) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            self._died()

    def _died(self):
        self.process.join(timeout=5)
        raise RuntimeError(f"the agents' process ended unasked (exit code {self.process.exitcode}); its error is "
                           "above in the log")

    def close(self) -> None:
        """Stop serving and end the process (every episode ended first: its agent is cancelled there)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        try:
            with self.send_lock:
                self.conn.send(Shutdown())
        except (BrokenPipeError, EOFError, OSError):
            pass
        self.process.join(timeout=15)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.conn.close()


# ---- the agents' side ----------------------------------------------------------------------------------------


def _agents_main(conn: Connection, settings: HostSettings) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C to the job is the engine's side's to handle)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the openai client logs every request through httpx at INFO: a line per call, thousands per step
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        with asyncio.Runner(loop_factory=_fastest_loop()) as runner:
            runner.run(AgentsProcess(conn, settings).run())
    finally:
        conn.close()


def _fastest_loop():
    """uvloop's event loop where it is installed (uvicorn's own choice: its I/O costs the agents' process less per
    call), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Sender:
    """Sends on the pipe from a thread of its own: the event loop never waits on a full pipe."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="reflow-agents-sender", daemon=True)
        self.thread.start()

    def send(self, message) -> None:
        self.queue.put(message)

    def _run(self) -> None:
        while (message := self.queue.get()) is not None:
            try:
                self.conn.send(message)
            except (BrokenPipeError, EOFError, ConnectionResetError):  # the engine's side is gone
                return

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)


class EpisodeBackend:
    """The endpoint's ``Backend`` in the agents' process: a call to a live episode goes to the engine's side,
    and waits for its turn there."""

    def __init__(self, settings: HostSettings, tokenizer, sender: _Sender, on_call: Callable[[str], None]):
        self.name, self.max_model_len, self.tokenizer = settings.name, settings.max_model_len, tokenizer
        self.on_call = on_call
        """Told each call's route (an episode's first call lets the next waiting agent start)."""
        self.temperature, self.top_p = settings.temperature, settings.top_p
        self.sender = sender
        self.routes: set[str] = set()
        """The live episodes."""
        self.calls: dict[int, tuple[str, asyncio.Future]] = {}
        """Each call waiting for its turn: its route and its answer."""
        self.ids = itertools.count()

    async def generate(self, route: str | None, call: Call) -> list[Completion]:
        if route is None:
            raise OpenAIError(404, "this endpoint serves agent episodes: use the base_url of the client your agent "
                              "was given", None, "not_found")
        if call.n != 1:
            raise OpenAIError(400, f"n must be 1 in an episode (one trajectory), got {call.n}: make one call per "
                              "completion", "n")
        for name, value, run in (("temperature", call.temperature, self.temperature), ("top_p", call.top_p, self.top_p)):
            if not math.isclose(value, run):
                raise OpenAIError(400, f"{name} = {value}: training samples at the run's rollout.{name} = {run} (the "
                                  f"distribution its log-probs assume); send {run} or leave it out", name)
        if route not in self.routes:
            raise OpenAIError(404, f"no episode {route!r} in flight (it ended, failed or was dropped)", None,
                              "episode_not_found")
        self.on_call(route)
        call_id = next(self.ids)
        answer = asyncio.get_running_loop().create_future()
        self.calls[call_id] = (route, answer)
        self.sender.send(CallMade(call_id, route, call))
        try:
            return await answer
        finally:
            self.calls.pop(call_id, None)

    def resolve(self, call_id: int, completions: list[Completion] | None, error: OpenAIError | None) -> None:
        route, answer = self.calls.get(call_id, (None, None))
        if answer is None or answer.done():
            return  # (its agent was cancelled meanwhile)
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(completions)

    def end(self, route: str) -> None:
        self.routes.discard(route)
        for call_id, (of, answer) in list(self.calls.items()):
            if of == route and not answer.done():
                answer.set_exception(OpenAIError(409, "this episode has ended", None, "episode_ended"))


class AgentsProcess:
    """The endpoint's server and every episode's agent, on one event loop."""

    def __init__(self, conn: Connection, settings: HostSettings):
        self.conn, self.settings = conn, settings
        self.sender = _Sender(conn)
        self.agents: dict[str, asyncio.Task] = {}
        self.waiting: dict[str, dict] = {}
        """Episodes to start, in order, with their rows (``STARTING_AT_ONCE``)."""
        self.starting: set[str] = set()
        """Agents started that have made no call yet."""
        self.ended_by_engine: set[str] = set()
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        import uvicorn

        from reflow.rollout.tokenizer import PromptTokenizer
        from reflow.serving.openai_api import build_app
        from reflow.serving.server import new_api_key, uvicorn_config
        from reflow.tasks.agent import AgentTask

        try:
            tokenizer = PromptTokenizer(self.settings.hf_dir, chat=self.settings.chat)
            self.task = AgentTask(self.settings.agent, self.settings.agent_timeout_s, self.settings.max_turns)
        except Exception as error:  # noqa: BLE001 - reported to the engine's side, which raises it
            self.conn.send(StartFailed(f"{type(error).__name__}: {error}"))
            return
        self.backend = EpisodeBackend(self.settings, tokenizer, self.sender, self._called)
        self.api_key = new_api_key()
        self.ssl = ssl.create_default_context()
        """Built once: an HTTP client builds one otherwise (loading the CA bundle), which took most of the
        agents' loop's time when each episode built its client. (Each episode's client ignores the environment's
        proxy settings, ``trust_env=False``: the endpoint is on loopback, and a cluster's HTTP_PROXY must not
        route an episode's calls away from it.)"""
        server = uvicorn.Server(uvicorn_config(build_app(self.backend, self.api_key), self.settings.host,
                                               self.settings.port))
        # (the engine's side decides when this process ends: a Ctrl-C reaches it, and it closes the pipe)
        server.capture_signals = contextlib.nullcontext
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                self.conn.send(StartFailed(f"the endpoint did not start on {self.settings.host} (is the port taken?)"))
                return
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        self.base_url = f"http://{host}:{port}"
        self.sender.send(Ready(self.base_url, self.api_key))
        reader = threading.Thread(target=self._read, args=(asyncio.get_running_loop(),), name="reflow-agents-reader",
                                  daemon=True)
        reader.start()
        await self.stopped.wait()
        for agent in self.agents.values():
            agent.cancel()
        await asyncio.gather(*self.agents.values(), return_exceptions=True)
        server.should_exit = True
        await serving
        self.sender.close()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: each message to the loop, in order. (A thread, not the loop's own reader: an event
        loop may set the pipe non-blocking, and the sender's writes would then fail on a full pipe.)"""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the engine's side is gone
                loop.call_soon_threadsafe(self.stopped.set)
                return
            loop.call_soon_threadsafe(self._handle, message)
            if isinstance(message, Shutdown):
                return

    def _handle(self, message) -> None:
        if isinstance(message, StartEpisode):
            self.backend.routes.add(message.route)
            self.waiting[message.route] = message.row
            self._start_waiting()
        elif isinstance(message, Answer):
            self.backend.resolve(message.call_id, message.completions, None)
        elif isinstance(message, Refuse):
            self.backend.resolve(message.call_id, None, message.refusal.error())
        elif isinstance(message, EndEpisode):
            self.backend.end(message.route)
            self.waiting.pop(message.route, None)
            agent = self.agents.get(message.route)
            if agent is not None and not agent.done():
                self.ended_by_engine.add(message.route)
                agent.cancel()
        elif isinstance(message, Shutdown):
            self.stopped.set()

    def _start_waiting(self) -> None:
        while self.waiting and len(self.starting) < STARTING_AT_ONCE:
            route = next(iter(self.waiting))
            row = self.waiting.pop(route)
            self.starting.add(route)
            self.agents[route] = asyncio.get_running_loop().create_task(self._episode(route, row))

    def _called(self, route: str) -> None:
        if route in self.starting:
            self.starting.discard(route)
            self._start_waiting()

    async def _episode(self, route: str, row: dict) -> None:
        import httpx

        ended = AgentEnded(route)
        try:
            value = await self.task.run_episode(self.base_url + f"/episodes/{route}/v1", self.api_key, row,
                                                httpx.AsyncClient(verify=self.ssl, trust_env=False))
            try:  # (as plain numbers: what the engine's side checks, and what pickles)
                if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
                    raise TypeError(f"the agent returned {type(value).__name__}")
                ended.value = float(value) if not isinstance(value, dict) else {
                    str(k): float(v) for k, v in value.items()}
            except (TypeError, ValueError) as error:
                ended.failure, ended.detail = "bad_reward", str(error)
        except asyncio.CancelledError:
            if route in self.ended_by_engine:
                self.ended_by_engine.discard(route)
                self._gone(route)
                return  # (the engine's side ended it: it needs no word back)
            ended.failure, ended.detail = "error", "the agent was cancelled"
        except TimeoutError:
            ended.failure = "timeout"
        except Exception as error:  # noqa: BLE001 - the agent's own bug: a scored failure, not the run's
            ended.failure, ended.detail = "error", f"{type(error).__name__}: {error}"
        self._gone(route)
        self.backend.end(route)
        self.sender.send(ended)

    def _gone(self, route: str) -> None:
        self.agents.pop(route, None)
        self._called(route)  # (its place among the starting agents, if it held one)


__all__ = ["AgentEnded", "AgentHost", "CallMade", "HostSettings"]
