"""The agents' process's own rules (``reflow.serving.agent_host``), on its real event loop, pipe and agent tasks,
without an engine: how many agents start at once, and what an episode's end does to its agent and its call. (The
whole path, with the engine and the real endpoint, is ``tests/serving/test_agents.py``.)"""

import asyncio
import multiprocessing as mp
import ssl

from reflow.serving.agent_host import (
    STARTING_AT_ONCE,
    AgentEnded,
    AgentsProcess,
    EndEpisode,
    EpisodeBackend,
    HostSettings,
    StartEpisode,
)
from reflow.serving.openai_api import Call, OpenAIError
from reflow.tasks.agent import AgentTask

RELEASE: asyncio.Event | None = None
STARTED: list[str] = []


async def waits_to_be_released(client, row):
    STARTED.append(row["id"])
    await RELEASE.wait()
    return 1.0


async def _settled(count: int) -> None:
    """Until ``count`` agents have started (10 s at most, a loaded machine), then a moment for any extra to show."""
    for _ in range(1000):
        if len(STARTED) >= count:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)


def _call() -> Call:
    return Call([1, 2, 3], 4, "max_tokens", 1, 1.0, 1.0, (), None, text="x")


def _process(conn) -> AgentsProcess:
    settings = HostSettings(f"{__name__}:waits_to_be_released", 30.0, 4, "", False, "tiny", 256, 1.0, 1.0)
    process = AgentsProcess(conn, settings)
    process.task = AgentTask(settings.agent, settings.agent_timeout_s, settings.max_turns)
    process.backend = EpisodeBackend(settings, None, process.sender, process._called)
    process.base_url, process.api_key, process.ssl = "http://127.0.0.1:9", "key", ssl.create_default_context()
    return process


def test_agents_start_a_bounded_number_at_once_and_each_first_call_lets_the_next_start():
    engine_side, agents_side = mp.Pipe(duplex=True)

    async def scenario():
        global RELEASE
        RELEASE = asyncio.Event()
        STARTED.clear()
        process = _process(agents_side)
        n = STARTING_AT_ONCE + 8
        for i in range(n):
            process._handle(StartEpisode(f"r{i}", {"id": f"r{i}"}))
        await _settled(STARTING_AT_ONCE)
        assert STARTED == [f"r{i}" for i in range(STARTING_AT_ONCE)]  # in order, and no more
        # an episode the engine's side ends before its agent started never starts, and sends nothing back
        process._handle(EndEpisode(f"r{STARTING_AT_ONCE}"))
        # a first call frees a place: the next waiting agent starts; a second call of the same episode does not
        calls = [asyncio.ensure_future(process.backend.generate("r0", _call())) for _ in range(2)]
        await _settled(STARTING_AT_ONCE + 1)
        assert STARTED[STARTING_AT_ONCE:] == [f"r{STARTING_AT_ONCE + 1}"]
        # an agent's end frees its place too (cancelled by the engine's side: no word back, its call refused)
        process._handle(EndEpisode("r1"))
        await _settled(STARTING_AT_ONCE + 2)
        assert STARTED[STARTING_AT_ONCE:] == [f"r{STARTING_AT_ONCE + 1}", f"r{STARTING_AT_ONCE + 2}"]
        process._handle(EndEpisode("r0"))
        for call in calls:
            try:
                await call
                raise AssertionError("an ended episode's call was answered")
            except OpenAIError as error:
                assert error.status == 409
        RELEASE.set()
        for _ in range(1000):
            if not process.agents:
                break
            await asyncio.sleep(0.01)
        assert sorted(STARTED) == sorted(f"r{i}" for i in range(n) if i not in (STARTING_AT_ONCE,))
        process.sender.close()

    asyncio.run(scenario())
    ended = []
    while engine_side.poll(0.5):
        message = engine_side.recv()
        if isinstance(message, AgentEnded):
            ended.append((message.route, message.value, message.failure))
    # every agent that ran to its end said so, with its reward; r0, r1 and the one never started did not
    assert sorted(ended) == sorted((f"r{i}", 1.0, None) for i in range(2, STARTING_AT_ONCE + 8)
                                   if i != STARTING_AT_ONCE)
