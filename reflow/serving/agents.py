"""Agent episodes: an agent written against the OpenAI API drives one trajectory through the run's endpoint.

    endpoint = AgentEndpoint(tokenizer, "tiny-qwen3", max_model_len, rollout)   # served by reflow.serving
    driver = AgentDriver(engine, task, tokenizer, endpoint, runner, rewards)    # a TurnDriver, for agents
    driver.add(request)      # start the agent of one episode; ``request`` becomes its trajectory
    driver.step()            # its calls into the engine, one engine step, its turns back: finished episodes

Threads, and who waits for whom:
  - the agent runs on the runner's event loop (``AgentRunner``) with an ``openai.AsyncOpenAI`` client whose
    base URL is its episode's (``/episodes/<id>/v1``), under ``task.agent_timeout_s``;
  - each of its calls reaches the endpoint's server thread, which parses it (``reflow.serving.openai_api``),
    queues it on the driver and waits for its turn;
  - the rollout worker's thread owns the engine: before each engine step the driver takes the queued calls,
    extends each episode's trajectory with the call's new prompt tokens and puts it back in the engine; a turn
    that ends is answered to its call. Between its calls an episode holds no engine slot (as a trajectory at
    its tool in ``reflow.rollout.turns``), so a slow agent blocks nothing; a weight sync holds the turns in the
    engine with their prefix, and each token keeps the version that sampled it.

Token-exact: the trained tokens are the sampled ones. A call's prompt must extend the trajectory: if its tokens
start with the trajectory's, the rest are the environment's (never trained). If they do not, the trajectory keeps
its tokens and gains only the context the call added, tokenized on its own, and the episode counts a mismatch
(``Sample.token_mismatches``): for a completion, the text after what its agent has seen (the previous prompt and
the text returned, which leaves out special tokens and the stop string); for a chat call that continues the
previous call's messages, the template's text after the reply (a re-serialized tool call, dropped reasoning).
A call that rewrites the conversation beyond that fails the episode.

Failures end an episode as a scored failure (reward 0, ``Sample.agent_failure`` its cause): the agent raised
("error"), ran past its time ("timeout"), made a call past ``task.max_turns`` ("turn_budget") or past the
trajectory's token budget ("token_budget"), rewrote its conversation ("diverged"), or returned no reward
("bad_reward"). Its turn in the engine is aborted (KV freed), its agent cancelled; nothing outlives the episode.
A malformed call gets OpenAI's error shape and leaves the episode as it was.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as futures
import logging
import math
import queue
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from reflow.rollout.protocols import Engine
from reflow.rollout.request import Request
from reflow.rollout.turns import run_to_end
from reflow.serving.chat import render_text
from reflow.serving.openai_api import Call, Completion, OpenAIError, completion_text
from reflow.types import AGENT_FAILURES as FAILURES

MARKER = "REFLOW-REPLY-7f3a9c"
"""A reply's stand-in body, to find where the chat template's text around a reply begins and ends."""

if TYPE_CHECKING:
    from reflow.config.job_config import RolloutSection
    from reflow.rewards import RewardMix
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.tasks.agent import AgentTask
    from reflow.types import WorkerStats



class EpisodeFailed(Exception):
    """A call that ends its episode (a budget, a rewritten conversation): the call gets ``error``."""

    def __init__(self, cause: str, error: OpenAIError):
        super().__init__(error.message)
        self.cause, self.error = cause, error


class AgentRunner:
    """An event loop on a thread of its own, where the agents run."""

    def __init__(self):
        # the openai client logs every request through httpx at INFO: a line per call, thousands per step
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.loop = asyncio.new_event_loop()
        self.ssl = ssl.create_default_context()
        """Built once: an HTTP client builds one otherwise (loading the CA bundle), which took most of the
        agents' loop's time when each episode built its client."""
        self.thread = threading.Thread(target=self.loop.run_forever, name="reflow-agents", daemon=True)
        self.thread.start()

    def start(self, coroutine) -> futures.Future:
        """Run ``coroutine``; the future resolves to its result (cancelling it cancels the coroutine)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def http_client(self):
        """An episode's own connection (one pool per episode: a pool shared by hundreds of episodes checks every
        connection on every request)."""
        import httpx

        return httpx.AsyncClient(verify=self.ssl)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass
class PendingCall:
    route: str
    call: Call
    answer: futures.Future
    """Resolves to the call's ``Completion`` list, or fails with an ``OpenAIError``."""


@dataclass
class Episode:
    route: str
    request: Request
    """The trajectory: the first call's prompt, then every turn's sampled tokens and the calls' new tokens."""
    outcome: futures.Future | None = None
    """The agent's run: its reward, or its error."""
    calls: int = 0
    turn: PendingCall | None = None
    """The call whose turn is in the engine."""
    turn_start: int = 0
    turn_logprobs_start: int = 0
    """Where the turn began in ``output_ids`` and in ``logprobs``."""
    answered_at: float | None = None
    """When its latest turn was answered (the agent's time since counts as tool time)."""
    failure: str | None = None
    mismatches: int = 0
    messages: list[dict] | None = None
    """The latest chat call's messages (a chat call that follows continues them)."""
    seen: str | None = None
    """After a completion call: its prompt and the text returned for it, as its agent saw them (a completion
    call that follows continues that text)."""


class AgentEndpoint:
    """The ``Backend`` of a run's endpoint (``reflow.serving.openai_api``): each call goes to the driver of its
    episode, whose thread answers it. One per rank, shared by that rank's drivers (the run's, the evaluation's)."""

    def __init__(self, tokenizer: "PromptTokenizer", name: str, max_model_len: int, rollout: "RolloutSection"):
        self.tokenizer, self.name, self.max_model_len = tokenizer, name, max_model_len
        self.temperature, self.top_p = rollout.temperature, rollout.top_p
        self.drivers: dict[str, "AgentDriver"] = {}
        """Each live episode's driver, by route."""
        self.lock = threading.Lock()
        self.base_url = ""
        self.api_key = ""
        """Set once the server listens (``serve``)."""
        self.server = None

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        from reflow.serving.openai_api import build_app
        from reflow.serving.server import EndpointServer, new_api_key

        self.api_key = new_api_key()
        self.server = EndpointServer(build_app(self, self.api_key), host, port)
        self.base_url = self.server.start()[: -len("/v1")]
        return self.base_url

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def episode_url(self, route: str) -> str:
        return f"{self.base_url}/episodes/{route}/v1"

    def register(self, route: str, driver: "AgentDriver") -> None:
        with self.lock:
            self.drivers[route] = driver

    def unregister(self, route: str) -> None:
        with self.lock:
            self.drivers.pop(route, None)

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
        with self.lock:
            driver = self.drivers.get(route)
        if driver is None:
            raise OpenAIError(404, f"no episode {route!r} in flight (it ended, failed or was dropped)", None,
                              "episode_not_found")
        answer: futures.Future = futures.Future()
        driver.submit(PendingCall(route, call, answer))
        return await asyncio.wrap_future(answer)


def episode_reward(value: Any, rewards: "RewardMix | None", response_tokens: int) -> tuple[float, dict | None]:
    """An agent's return as (reward, its parts): a number is the 'task' reward; a dict names each part, for the
    run's ``[reward]`` mix (every function it names must be there). Without a mix (the held-out evaluation):
    the number, or the dict's 'task' entry."""
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise ValueError(f"the agent returned {type(value).__name__}; return a number or a dict of named rewards")
    parts = {"task": float(value)} if not isinstance(value, dict) else {str(k): float(v) for k, v in value.items()}
    if not all(math.isfinite(v) for v in parts.values()):
        raise ValueError(f"the agent returned a reward that is not finite: {parts}")
    if rewards is None:
        if "task" not in parts:
            raise ValueError(f"the agent's rewards {sorted(parts)} have no 'task' entry, which evaluation reports")
        return parts["task"], None
    return rewards.combine(parts, response_tokens)


class AgentDriver:
    """The ``TurnDriver`` of an agent task: the same calls, with agents in place of an environment."""

    def __init__(
        self, engine: Engine, task: "AgentTask", tokenizer: "PromptTokenizer", endpoint: AgentEndpoint,
        runner: AgentRunner, rewards: "RewardMix | None" = None, clock: Callable[[], float] = time.perf_counter,
    ):
        self.engine, self.task, self.tokenizer, self.endpoint, self.runner = engine, task, tokenizer, endpoint, runner
        self.rewards = rewards
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        """Every episode started and not finished, by route."""
        self.by_request: dict[str, Episode] = {}
        self.inbox: queue.Queue[PendingCall] = queue.Queue()
        self.wakeup = threading.Event()
        """Set by a call or an agent's end: what the driver waits on with nothing in the engine."""
        self.tool_wait_s = 0.0
        self.stepped = False
        self.scoring: dict = {}
        """(A ``TurnDriver``'s trajectories being scored: an agent's reward comes with its end.)"""

    # ---- the TurnDriver interface ----------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self.episodes)

    @property
    def waiting(self) -> dict[str, Request]:
        """The trajectories out of the engine while their agent holds the turn (admission counts them in flight,
        as it counts a ``TurnDriver``'s trajectories at their tool)."""
        return {e.route: e.request for e in self.episodes.values() if e.turn is None}

    @property
    def num_waiting_on_tools(self) -> int:
        """Episodes whose agent holds the turn (between two calls)."""
        return sum(1 for e in self.episodes.values() if e.turn is None)

    def add(self, req: Request) -> None:
        """Start the agent of a new episode; ``req`` (its prompt an estimate, for admission) is its trajectory."""
        episode = Episode(uuid.uuid4().hex, req)
        self.episodes[episode.route] = episode
        self.by_request[req.request_id] = episode
        self.endpoint.register(episode.route, self)
        episode.answered_at = self.clock()
        episode.outcome = self.runner.start(self.task.run_episode(self.endpoint, episode.route, req.meta["problem"],
                                                                self.runner.http_client()))
        episode.outcome.add_done_callback(lambda _: self.wakeup.set())

    def submit(self, pending: PendingCall) -> None:
        """From the endpoint's thread: a call to take before the next engine step."""
        self.inbox.put(pending)
        self.wakeup.set()

    def step(self) -> list[Request]:
        finished: list[Request] = []
        self._take_calls(finished)
        self._end_agents(finished)
        self.stepped = self.engine.num_active > 0
        if self.stepped:
            for req in self.engine.step():
                self._answer(req)
        elif self.episodes:
            t0 = time.perf_counter()
            self.wakeup.wait(timeout=0.05)
            self.tool_wait_s += time.perf_counter() - t0
        self.wakeup.clear()
        return finished

    def step_until_started(self) -> list[Request]:
        """one_step_off's rule before a weight sync (every admitted trajectory has its first token from its
        admission version): step until every episode has made its first call and has a token, or has ended.
        An agent slow to make its first call holds the sync up to ``task.agent_timeout_s``; async and reflow
        do not call this (an episode that starts after the sync is born newer, never staler)."""
        finished: list[Request] = []
        while any(not e.request.output_ids for e in self.episodes.values()):
            finished.extend(self.step())
        return finished

    def generate(self, requests: Iterable[Request], stats: "WorkerStats | None" = None) -> list[Request]:
        for req in requests:
            self.add(req)
        return run_to_end(self, stats)

    def hold_all(self) -> list[Request]:
        """The turns in the engine, stopped with their prefix (a weight sync); they resume with ``resume``."""
        return self.engine.hold_all()

    def resume(self, held: Iterable[Request]) -> None:
        self.engine.resume(held)

    def drop_all(self) -> list[Request]:
        """End every episode unfinished (the end of a run): turns aborted, agents cancelled, calls refused."""
        self.engine.hold_all()
        dropped = []
        for episode in list(self.episodes.values()):
            self._close(episode, OpenAIError(503, "the run stopped; this episode was dropped", None, "episode_dropped"))
            dropped.append(episode.request)
        self._refuse_queued()
        return dropped

    def take_tool_wait(self) -> float:
        waited, self.tool_wait_s = self.tool_wait_s, 0.0
        return waited

    # ---- calls -----------------------------------------------------------------------------------

    def _take_calls(self, finished: list[Request]) -> None:
        while True:
            try:
                pending = self.inbox.get_nowait()
            except queue.Empty:
                return
            episode = self.episodes.get(pending.route)
            if episode is None:
                pending.answer.set_exception(OpenAIError(404, f"no episode {pending.route!r} in flight", None,
                                                         "episode_not_found"))
                continue
            if episode.turn is not None:
                pending.answer.set_exception(OpenAIError(409, "this episode has a call in flight already: one call "
                                                         "at a time per episode", None, "call_in_flight"))
                continue
            try:
                self._start_turn(episode, pending)
            except EpisodeFailed as failed:
                pending.answer.set_exception(failed.error)
                self._fail(episode, failed.cause, finished)
            except OpenAIError as error:
                pending.answer.set_exception(error)

    def _start_turn(self, episode: Episode, pending: PendingCall) -> None:
        req, call = episode.request, pending.call
        if episode.calls >= self.task.max_turns:
            raise EpisodeFailed("turn_budget", OpenAIError(
                400, f"this episode made its {self.task.max_turns} calls (task.max_turns)", None, "turn_budget"))
        if episode.calls == 0:
            req.prompt_ids, new = list(call.prompt_ids), []
        else:
            new = self._new_tokens(episode, call)
        response = len(req.output_ids) + len(new)
        room = min(req.max_tokens - response, self.endpoint.max_model_len - len(req.prompt_ids) - response)
        if room <= 0:
            raise EpisodeFailed("token_budget", OpenAIError(
                400, f"the trajectory has {len(req.prompt_ids)} prompt and {response} response tokens: no room left "
                f"(rollout.max_new_tokens = {req.max_tokens}, rollout.max_model_len = {self.endpoint.max_model_len})",
                pending.call.max_tokens_param, "context_length_exceeded"))
        if episode.calls and episode.answered_at is not None:
            req.tool_calls += 1
            req.tool_s += self.clock() - episode.answered_at
        episode.calls += 1
        req.append_environment_tokens(new)
        episode.messages = [dict(m) for m in call.messages] if call.messages is not None else None
        req.stop = call.stop
        req.turn_end = response + min(room, call.max_tokens or room)
        req.finish_reason = req.stop_reason = None
        episode.turn, episode.turn_start, episode.turn_logprobs_start = pending, len(req.output_ids), len(req.logprobs)
        self.engine.add(req)

    def _new_tokens(self, episode: Episode, call: Call) -> list[int]:
        """The tokens ``call`` adds after the trajectory: exactly its own when its prompt extends the trajectory's
        tokens; else (a mismatch) the context it adds, read from its messages (a chat call) or its text (a
        completion), tokenized on its own."""
        req = episode.request
        sampled = req.prompt_ids + req.output_ids
        if call.prompt_ids[: len(sampled)] == sampled:
            return list(call.prompt_ids[len(sampled):])
        if call.messages is not None:
            added = self._added_after_last_turn(episode, call)
        else:
            added = self._added_text(episode, self.tokenizer.tok.decode(call.prompt_ids, skip_special_tokens=False))
        if added is None:
            raise EpisodeFailed("diverged", OpenAIError(
                400, "this call's conversation does not continue the episode's: send every earlier message as it was, "
                "the assistant's as they were returned", "messages" if call.messages is not None else "prompt",
                "conversation_diverged"))
        episode.mismatches += 1
        return self.tokenizer.tok(added, add_special_tokens=False).input_ids

    def _added_text(self, episode: Episode, wants: str) -> str | None:
        """The text a completion call adds after what its agent has seen (``Episode.seen``: the previous call's
        prompt and the text returned for it, which leaves out special tokens and the stop string). A stop string
        the agent sends back is the trajectory's already."""
        if episode.seen is None or not wants.startswith(episode.seen):
            return None
        added = wants[len(episode.seen):]
        stop = episode.request.stop_reason
        return added[len(stop):] if isinstance(stop, str) and added.startswith(stop) else added

    def _saw(self, episode: Episode, call: Call) -> None:
        """A turn answered to ``call``: what its agent has seen since, as text."""
        req = episode.request
        episode.seen = self.tokenizer.tok.decode(call.prompt_ids, skip_special_tokens=False) + completion_text(
            self.tokenizer, req.output_ids[episode.turn_start:], req.stop_reason)

    def _added_after_last_turn(self, episode: Episode, call: Call) -> str | None:
        """A chat call that continues the episode's conversation (the previous call's messages, its reply, then
        new messages) where the reply re-renders differently from what was sampled (a re-serialized tool call,
        reasoning the template drops from earlier turns): the template's close of the reply, less what the
        sampled turn already ends with (its end-of-turn token), then the text of the new messages."""
        earlier = episode.messages
        if call.messages is None or earlier is None:
            return None
        n = len(earlier)
        if call.messages[:n] != earlier or len(call.messages) <= n or call.messages[n].get("role") != "assistant":
            return None
        tok = self.tokenizer.tok
        # the conversation as sent, with the reply's body a marker: what follows the marker is the close and the
        # new messages as the template writes them after a reply (no other message changes with the body)
        stand_in = [*earlier, {"role": "assistant", "content": MARKER}, *call.messages[n + 1:]]
        following = render_text(tok, stand_in, call.tools, generation_prompt=True)
        following = following[following.rindex(MARKER) + len(MARKER):]
        close = render_text(tok, stand_in[: n + 1], call.tools, generation_prompt=False)
        close = close[close.rindex(MARKER) + len(MARKER):]
        turn = tok.decode(episode.request.output_ids[episode.turn_start:], skip_special_tokens=False)
        for k in range(len(close), 0, -1):  # the sampled turn's end, where it is the close's start
            if turn.endswith(close[:k]) and following.startswith(close[:k]):
                return following[k:]
        return following

    def _answer(self, req: Request) -> None:
        """A turn the engine ended: to its call."""
        episode = self.by_request.get(req.request_id)
        if episode is None or episode.turn is None:
            return
        pending, episode.turn = episode.turn, None
        req.turn_end = None
        if pending.call.messages is None:
            self._saw(episode, pending.call)
        prefix = req.prompt_ids + req.output_ids[: episode.turn_start]
        episode.answered_at = self.clock()
        pending.answer.set_result([Completion(
            prefix, req.output_ids[episode.turn_start:], req.logprobs[episode.turn_logprobs_start:], req.finish_reason,
            req.stop_reason,
        )])

    # ---- ends ------------------------------------------------------------------------------------

    def _end_agents(self, finished: list[Request]) -> None:
        for episode in [e for e in self.episodes.values() if e.outcome.done()]:
            try:
                value = episode.outcome.result()
            except TimeoutError:
                self._fail(episode, "timeout", finished)
                continue
            except futures.CancelledError:
                self._fail(episode, "error", finished)
                continue
            except Exception:
                self._fail(episode, "error", finished)
                continue
            req = episode.request
            try:
                req.reward, req.reward_parts = episode_reward(value, self.rewards, len(req.output_ids))
            except (ValueError, TypeError):
                self._fail(episode, "bad_reward", finished)
                continue
            self._finish(episode, finished)

    def _fail(self, episode: Episode, cause: str, finished: list[Request]) -> None:
        req = episode.request
        episode.failure = cause
        req.reward = 0.0
        req.reward_parts = {name: 0.0 for name in self.rewards.part_names} if self.rewards is not None else None
        self._finish(episode, finished)

    def _finish(self, episode: Episode, finished: list[Request]) -> None:
        req = episode.request
        self._close(episode, OpenAIError(409, "this episode has ended", None, "episode_ended"))
        req.meta["agent_failure"] = episode.failure or ""
        req.meta["token_mismatches"] = episode.mismatches
        if req.finish_reason is None:
            req.finish_reason = "abort"
        finished.append(req)

    def _close(self, episode: Episode, refusal: OpenAIError) -> None:
        """Nothing of ``episode`` outlives it: its turn aborted in the engine, its call refused, its agent
        cancelled, its route gone."""
        self.engine.abort(episode.request.request_id)
        if episode.turn is not None:
            episode.turn.answer.set_exception(refusal)
            episode.turn = None
        episode.request.turn_end = None
        if episode.outcome is not None and not episode.outcome.done():
            episode.outcome.cancel()
        self.endpoint.unregister(episode.route)
        self.episodes.pop(episode.route, None)
        self.by_request.pop(episode.request.request_id, None)

    def _refuse_queued(self) -> None:
        while True:
            try:
                pending = self.inbox.get_nowait()
            except queue.Empty:
                return
            pending.answer.set_exception(OpenAIError(503, "the run stopped", None, "episode_dropped"))


__all__ = ["AgentDriver", "AgentEndpoint", "AgentRunner", "Episode", "FAILURES", "episode_reward"]
