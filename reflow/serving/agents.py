"""Agent episodes: an agent written against the OpenAI API drives one trajectory through the run's endpoint.

    host = AgentHost.start(task, tokenizer, "tiny-qwen3", rollout)       # the agents' process (agent_host)
    driver = AgentDriver(engine, task, tokenizer, host, rewards)          # a TurnDriver, for agents
    driver.add(request)      # start the agent of one episode; ``request`` becomes its trajectory
    driver.step()            # its calls into the engine, one engine step, its turns back: finished episodes

Processes, and who waits for whom:
  - the agents run in the rank's agents' process (``reflow.serving.agent_host``), each with an
    ``openai.AsyncOpenAI`` client whose base URL is its episode's (``/episodes/<id>/v1``), under
    ``task.agent_timeout_s``; the endpoint's server runs there too, parses each call
    (``reflow.serving.openai_api``), sends it here and waits for its turn;
  - the rollout worker's thread owns the engine and this driver: before each engine step it takes what the agents'
    process sent (calls, agents' ends), extends each calling episode's trajectory with the call's new prompt tokens
    and puts it back in the engine; a turn that ends is answered to its call. Between its calls an episode holds no
    engine slot (as a trajectory at its tool in ``reflow.rollout.turns``), so a slow agent blocks nothing; a
    weight sync holds the turns in the engine with their prefix, and each token keeps the version that sampled it.

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

import logging
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from reflow.rollout.protocols import Engine
from reflow.rollout.request import Request
from reflow.rollout.turns import run_to_end
from reflow.serving.agent_host import AgentEnded, AgentHost, CallMade
from reflow.serving.chat import render_text
from reflow.serving.openai_api import Call, Completion, OpenAIError, completion_text
from reflow.tasks.agent import agent_row
from reflow.types import AGENT_FAILURES as FAILURES

logger = logging.getLogger(__name__)

MARKER = "REFLOW-REPLY-7f3a9c"
"""A reply's stand-in body, to find where the chat template's text around a reply begins and ends."""

if TYPE_CHECKING:
    from reflow.rewards import RewardMix
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.tasks.agent import AgentTask
    from reflow.types import WorkerStats



class EpisodeFailed(Exception):
    """A call that ends its episode (a budget, a rewritten conversation): the call gets ``error``."""

    def __init__(self, cause: str, error: OpenAIError):
        super().__init__(error.message)
        self.cause, self.error = cause, error


@dataclass
class PendingCall:
    call_id: int
    """The call's number in the agents' process (``AgentHost.answer`` and ``refuse`` take it)."""
    route: str
    call: Call


@dataclass
class Episode:
    route: str
    request: Request
    """The trajectory: the first call's prompt, then every turn's sampled tokens and the calls' new tokens."""
    ended: AgentEnded | None = None
    """The agent's end, once it came: its return, or its failure's cause."""
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
    last_completion: tuple[Call, list[int], str | int | None] | None = None
    """After a completion call: the call, its turn's tokens and its stop reason. What its agent has seen since
    (``AgentDriver._seen``), the text a completion call that follows must continue, is read from them only where
    that call's tokens do not extend the trajectory (decoding every call on the engine's thread cost it time)."""


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
        self, engine: Engine, task: "AgentTask", tokenizer: "PromptTokenizer", host: AgentHost,
        rewards: "RewardMix | None" = None, clock: Callable[[], float] = time.perf_counter,
    ):
        self.engine, self.task, self.tokenizer, self.host = engine, task, tokenizer, host
        self.rewards = rewards
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        """Every episode started and not finished, by route."""
        self.by_request: dict[str, Episode] = {}
        self.inbox: deque[CallMade | AgentEnded] = deque()
        """What the agents' process sent for this driver's episodes (``AgentHost.deliver``), in order."""
        self.errors_logged = 0
        self.tool_wait_s = 0.0
        self.stepped = False
        self.scoring: dict = {}
        """(A ``TurnDriver``'s trajectories being scored: an agent's reward comes with its end.)"""

    @property
    def max_model_len(self) -> int:
        return self.host.settings.max_model_len

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
        self.host.register(episode.route, self)
        episode.answered_at = self.clock()
        self.host.start_episode(episode.route, agent_row(req.meta["problem"], self.host.name))

    def receive(self, message: CallMade | AgentEnded) -> None:
        """From ``AgentHost.deliver``: a call, or an agent's end, to take before the next engine step."""
        self.inbox.append(message)

    def step(self) -> list[Request]:
        finished: list[Request] = []
        self.host.deliver()
        self._take_messages(finished)
        self._end_agents(finished)
        self.stepped = self.engine.num_active > 0
        if self.stepped:
            for req in self.engine.step():
                self._answer(req)
        elif self.episodes:
            t0 = time.perf_counter()
            self.host.deliver(timeout_s=0.05)
            self.tool_wait_s += time.perf_counter() - t0
        return finished

    def step_until_started(self) -> tuple[list[Request], list[int]]:
        """one_step_off's rule before a weight sync (every admitted trajectory has its first token from its
        admission version): step until every episode has made its first call and has a token, or has ended.
        An agent slow to make its first call holds the sync up to ``task.agent_timeout_s``; async and reflow
        do not call this (an episode that starts after the sync is born newer, never staler). Returns what
        finished and the sequences of each engine step (a pass that only waited on agents steps nothing)."""
        finished: list[Request] = []
        sequences: list[int] = []
        while any(not e.request.output_ids for e in self.episodes.values()):
            in_engine = self.engine.num_active
            finished.extend(self.step())
            if self.stepped:
                sequences += [in_engine] * self.engine.decode_steps
        return finished, sequences

    def generate(self, requests: Iterable[Request], stats: "WorkerStats | None" = None) -> list[Request]:
        for req in requests:
            self.add(req)
        return run_to_end(self, stats)

    def hold_all(self) -> list[Request]:
        """The turns in the engine, stopped with their prefix (a placement change, a sync that evaluates); they
        resume with ``resume``."""
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

    def _take_messages(self, finished: list[Request]) -> None:
        while self.inbox:
            message = self.inbox.popleft()
            episode = self.episodes.get(message.route)
            if isinstance(message, AgentEnded):
                if episode is not None:
                    episode.ended = message
                continue
            if episode is None:
                self.host.refuse(message.call_id, OpenAIError(404, f"no episode {message.route!r} in flight", None,
                                                              "episode_not_found"))
                continue
            if episode.turn is not None:
                self.host.refuse(message.call_id, OpenAIError(409, "this episode has a call in flight already: one "
                                                              "call at a time per episode", None, "call_in_flight"))
                continue
            pending = PendingCall(message.call_id, message.route, message.call)
            try:
                self._start_turn(episode, pending)
            except EpisodeFailed as failed:
                self.host.refuse(pending.call_id, failed.error)
                self._fail(episode, failed.cause, finished)
            except OpenAIError as error:
                self.host.refuse(pending.call_id, error)

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
        room = min(req.max_tokens - response, self.max_model_len - len(req.prompt_ids) - response)
        if room <= 0:
            raise EpisodeFailed("token_budget", OpenAIError(
                400, f"the trajectory has {len(req.prompt_ids)} prompt and {response} response tokens: no room left "
                f"(rollout.max_new_tokens = {req.max_tokens}, rollout.max_model_len = {self.max_model_len})",
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
        """The text a completion call adds after what its agent has seen (``_seen``). A stop string the agent
        sends back is the trajectory's already."""
        seen = self._seen(episode)
        if seen is None or not wants.startswith(seen):
            return None
        added = wants[len(seen):]
        stop = episode.last_completion[2]
        return added[len(stop):] if isinstance(stop, str) and added.startswith(stop) else added

    def _seen(self, episode: Episode) -> str | None:
        """What the agent of ``episode`` has seen since its last completion call: that call's prompt and the text
        returned for it (which leaves out special tokens and the stop string)."""
        if episode.last_completion is None:
            return None
        call, turn, stop = episode.last_completion
        return self.tokenizer.tok.decode(call.prompt_ids, skip_special_tokens=False) + completion_text(
            self.tokenizer, turn, stop)

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
            episode.last_completion = (pending.call, req.output_ids[episode.turn_start:], req.stop_reason)
        prefix = req.prompt_ids + req.output_ids[: episode.turn_start]
        episode.answered_at = self.clock()
        self.host.answer(pending.call_id, [Completion(
            prefix, req.output_ids[episode.turn_start:], req.logprobs[episode.turn_logprobs_start:], req.finish_reason,
            req.stop_reason,
        )])

    # ---- ends ------------------------------------------------------------------------------------

    def _end_agents(self, finished: list[Request]) -> None:
        for episode in [e for e in self.episodes.values() if e.ended is not None]:
            ended = episode.ended
            if ended.failure is not None:
                if ended.failure == "error" and self.errors_logged < 3:
                    self.errors_logged += 1
                    logger.warning("an agent failed (scored 0, counted in agent_error): %s", ended.detail)
                self._fail(episode, ended.failure, finished)
                continue
            req = episode.request
            try:
                req.reward, req.reward_parts = episode_reward(ended.value, self.rewards, len(req.output_ids))
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
            self.host.refuse(episode.turn.call_id, refusal)
            episode.turn = None
        episode.request.turn_end = None
        self.host.end_episode(episode.route)
        self.episodes.pop(episode.route, None)
        self.by_request.pop(episode.request.request_id, None)

    def _refuse_queued(self) -> None:
        self.host.deliver()
        while self.inbox:
            message = self.inbox.popleft()
            if isinstance(message, CallMade):
                self.host.refuse(message.call_id, OpenAIError(503, "the run stopped", None, "episode_dropped"))


__all__ = ["AgentDriver", "Episode", "FAILURES", "episode_reward"]
