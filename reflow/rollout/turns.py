"""Multi-turn trajectories: the engine generates a model turn, the environment answers, the model goes on.

    TurnDriver(engine, task, tokenizer, workers).add(request) / step() -> finished trajectories

A request of a multi-turn task stops at the end of a tool call (one of ``environment.stop``). The driver
then hands the response so far to the environment on a worker thread, and the engine goes on with every
other request meanwhile: a trajectory waiting on a tool holds no engine slot and blocks nothing. When
the answer arrives (checked before each engine step), its tokens are appended to the response as the
environment's (no log-prob, no version, outside ``model_spans``, so never a training target) and the
request goes back into the engine, where it resumes from its whole prefix. A trajectory ends at EOS, at
the length limit (an answer that does not fit ends it too: it is not appended), when the environment
answers None, or at a tool call past ``environment.max_turns``.

Weight syncs reload the engine under the requests in it (``Engine.load_weights``); a trajectory waiting on
its tool stays waiting and re-enters the engine under the new weights when its answer comes, with every turn
it had.
Either way its tokens keep the versions that produced them, as any partial rollout's.

A finished multi-turn trajectory is scored on the same threads (``task.reward`` may run the coding agent's
tests, or math-verify), and returned with ``Request.reward`` set once its score is in: scoring never
blocks the engine either.

Accounting: each trajectory counts its tool calls and the wall time it waited on them (``tool_s``);
the driver counts the time it blocked with an empty engine waiting on tools (``tool_wait_s``), which a
rollout worker reports apart from engine time and idle time. Single-turn tasks (no environment) pass
straight through to the engine, and are scored by the caller.
"""

from __future__ import annotations

import concurrent.futures as futures
import time
from typing import TYPE_CHECKING, Iterable, Protocol

from reflow.rollout.protocols import Engine
from reflow.rollout.request import Request
from reflow.rollout.scoring import trajectory_reward
from reflow.tasks.base import Task

if TYPE_CHECKING:
    from reflow.rewards import RewardMix
    from reflow.rollout.tokenizer import PromptTokenizer
    from reflow.types import WorkerStats


class TurnDriver:
    def __init__(
        self, engine: Engine, task: Task | None, tokenizer: "PromptTokenizer | None", workers: int = 8,
        rewards: "RewardMix | None" = None,
    ):
        """``task`` None: single-turn requests only (the simulator, whose engine models tool turns itself).
        ``rewards``: the run's reward mix a finished multi-turn trajectory is scored with (None: the task's own
        reward, as the held-out evaluation scores)."""
        self.engine = engine
        self.task = task
        self.rewards = rewards
        self.environment = task.environment if task is not None else None
        self.tokenizer = tokenizer
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool") if self.environment else None
        self.waiting: dict[futures.Future, Request] = {}
        """Trajectories whose latest tool call is with the environment."""
        self.scoring: dict[futures.Future, Request] = {}
        """Finished multi-turn trajectories whose reward is being computed."""
        self.tool_wait_s = 0.0
        self.stepped = False
        """Whether the latest ``step`` stepped the engine (else it waited on a tool)."""

    @property
    def num_active(self) -> int:
        """Trajectories not finished: in the engine, waiting on a tool, or being scored."""
        return self.engine.num_active + len(self.waiting) + len(self.scoring)

    @property
    def num_waiting_on_tools(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        if self.environment is not None:
            req.stop = tuple(self.environment.stop)
        self.engine.add(req)

    def step(self) -> list[Request]:
        """Resume the trajectories whose tool answered, then one engine step (or, with an empty engine, a short
        wait for a tool); returns the trajectories that finished."""
        finished: list[Request] = []
        self._resume_answered(finished)
        self.stepped = self.engine.num_active > 0
        if self.stepped:
            stopped = self.engine.step()
        else:
            if self.waiting or self.scoring:
                t0 = time.perf_counter()
                futures.wait(list(self.waiting) + list(self.scoring), timeout=0.05, return_when=futures.FIRST_COMPLETED)
                self.tool_wait_s += time.perf_counter() - t0
                self._resume_answered(finished)
            stopped = []
        for req in stopped:
            self._route(req, finished)
        return finished

    def step_until_started(self) -> tuple[list[Request], list[int]]:
        """``RolloutEngine.step_until_started`` (before a weight sync), with the requests that stopped meanwhile
        routed as in ``step``; returns the trajectories that finished and the sequences of each engine step."""
        finished: list[Request] = []
        stopped, sequences = self.engine.step_until_started()
        for req in stopped:
            self._route(req, finished)
        return finished, sequences

    def generate(self, requests: Iterable[Request], stats: "WorkerStats | None" = None) -> list[Request]:
        """Run trajectories to their end (the synchronous path). Everything the driver holds runs to its end and
        is returned: use a driver that holds nothing else (a rollout worker evaluates on a driver of its own).
        ``stats``, if given, gains the engine steps, the sequences they stepped and the prompt tokens prefilled
        (what a decoupled rollout worker reports, and what ``reflow.sim.profiles.fit_profile`` reads)."""
        for req in requests:
            self.add(req)
            if stats is not None:
                stats.prefilled_tokens += len(req.prompt_ids)
        return run_to_end(self, stats)

    def hold_all(self) -> list[Request]:
        """The engine's requests, stopped with their prefix (a placement change, a sync that evaluates); those
        waiting on a tool stay."""
        return self.engine.hold_all()

    def resume(self, held: Iterable[Request]) -> None:
        self.engine.resume(held)

    def drop_all(self) -> list[Request]:
        """Stop everything (the end of a run): the engine's requests and those waiting on a tool (their answers
        are ignored)."""
        dropped = self.engine.hold_all() + list(self.waiting.values()) + list(self.scoring.values())
        for future in [*self.waiting, *self.scoring]:
            future.cancel()  # a call not started yet never runs; a running one finishes, unread
        self.waiting.clear()
        self.scoring.clear()
        return dropped

    def take_tool_wait(self) -> float:
        waited, self.tool_wait_s = self.tool_wait_s, 0.0
        return waited

    # ---- internals ---------------------------------------------------------------------------

    def _route(self, req: Request, finished: list[Request]) -> None:
        """A request that left the engine: to its environment (a tool call), or finished."""
        if self._calls_tool(req):
            transcript = self.tokenizer.decode(req.output_ids)
            self.waiting[self.pool.submit(self._respond, req, transcript)] = req
        else:
            self._finish(req, finished)

    def _finish(self, req: Request, finished: list[Request]) -> None:
        """A multi-turn trajectory is scored on the pool first (a tool-using reward may run code); a single-turn
        one is the caller's to score (``reflow.rollout.scoring.score``, through the same reward path)."""
        if self.environment is None:
            finished.append(req)
            return
        self.scoring[self.pool.submit(self._score, req)] = req

    def _score(self, req: Request) -> None:
        trajectory_reward(self.task, self.tokenizer, req, self.rewards)

    def _calls_tool(self, req: Request) -> bool:
        env = self.environment
        return (
            env is not None and req.finish_reason == "stop" and req.stop_reason in env.stop
            and req.tool_calls < env.max_turns and len(req.output_ids) < req.max_tokens
        )

    def _respond(self, req: Request, transcript: str) -> str | None:
        """On a worker thread: the environment's answer, timed into the trajectory."""
        t0 = time.perf_counter()
        try:
            return self.environment.respond(req.meta["problem"], transcript)
        finally:
            req.tool_calls += 1
            req.tool_s += time.perf_counter() - t0

    def _resume_answered(self, finished: list[Request]) -> None:
        if not self.scoring and not self.waiting:  # (a single-turn task: before every engine step)
            return
        for future in [f for f in self.scoring if f.done()]:
            future.result()  # a reward that raises is a bug in the task: it surfaces here
            finished.append(self.scoring.pop(future))
        for future in [f for f in self.waiting if f.done()]:
            req = self.waiting.pop(future)
            answer = future.result()  # an environment that raises is a bug in it: it surfaces here
            answer_ids = self.tokenizer.encode_continuation(answer) if answer is not None else []
            if answer is None or len(req.output_ids) + len(answer_ids) >= req.max_tokens:
                req.finish_reason = "stop" if answer is None else "length"
                self._finish(req, finished)
                continue
            req.append_environment_tokens(answer_ids)
            req.finish_reason = req.stop_reason = None
            self.engine.add(req)


class SteppedDriver(Protocol):
    """What ``run_to_end`` steps: a ``TurnDriver``, or an agent task's ``reflow.serving.agents.AgentDriver``."""

    engine: Engine
    stepped: bool

    @property
    def num_active(self) -> int: ...

    def step(self) -> list[Request]: ...


class RolloutDriver(SteppedDriver, Protocol):
    """What a ``reflow.modes.rollout_worker.RolloutWorker`` drives between the engine and the environment: a
    ``TurnDriver``, or an agent task's ``reflow.serving.agents.AgentDriver``."""

    scoring: dict
    """Finished trajectories whose reward is being computed."""
    waiting: dict
    """Trajectories out of the engine, at their tool or agent (admission counts them in flight)."""

    @property
    def num_waiting_on_tools(self) -> int: ...

    def add(self, req: Request) -> None: ...

    def step_until_started(self) -> tuple[list[Request], list[int]]: ...

    def hold_all(self) -> list[Request]: ...

    def resume(self, held: Iterable[Request]) -> None: ...

    def drop_all(self) -> list[Request]: ...

    def take_tool_wait(self) -> float: ...


def run_to_end(driver: SteppedDriver, stats: "WorkerStats | None" = None) -> list[Request]:
    """Step ``driver`` until it holds nothing; returns what finished. ``stats`` gains the engine steps, the
    sequences in flight they stepped (the steps that waited on a tool or an agent step nothing) and the tokens
    they sampled."""
    done: list[Request] = []
    sampled = driver.engine.sampled_tokens
    while driver.num_active:
        sequences = driver.engine.num_active
        done.extend(driver.step())
        if stats is not None and driver.stepped:
            stats.engine_steps += driver.engine.decode_steps
            stats.step_sequences += sequences * driver.engine.decode_steps
    if stats is not None:
        stats.sampled_tokens += driver.engine.sampled_tokens - sampled
    return done
