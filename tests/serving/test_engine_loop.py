"""``EngineLoop``: one thread owns an engine (the simulator's, a real ``Engine``: no vLLM needed) and serves
requests submitted from other threads; every future resolves, whatever happens."""

import threading

import pytest

from reflow.rollout.request import Request
from reflow.serving.engine_loop import EngineLoop, EngineLoopClosed
from reflow.sim.engine import SimEngine, SimTrajectory
from reflow.sim.profiles import TINY_CPU


def request(name: str, tokens: int = 5) -> Request:
    return Request(name, [1, 2, 3], 64, seed=0, meta={"group": name, "sim": SimTrajectory(tokens)})


def test_requests_from_many_threads_each_get_their_own_completion():
    loop = EngineLoop(SimEngine(TINY_CPU, 0, max_steps=4))
    futures: dict[str, object] = {}

    def client(k: int):
        for j in range(5):
            name = f"c{k}-{j}"
            futures[name] = loop.submit(request(name, tokens=1 + (k + j) % 7))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = {name: future.result(timeout=30) for name, future in futures.items()}
    assert all(req.request_id == name and req.finish_reason is not None for name, req in done.items())
    assert all(len(req.output_ids) == req.meta["sim"].target_tokens for req in done.values())
    loop.close()


def test_a_request_the_engine_refuses_fails_alone_and_the_loop_goes_on():
    loop = EngineLoop(SimEngine(TINY_CPU, 0, max_steps=4))
    good = loop.submit(request("good"))
    refused = loop.submit(Request("refused", [1], 8, seed=0, meta={}))  # no trajectory: the engine's add raises
    twice = [loop.submit(request("same", tokens=30)), loop.submit(request("same", tokens=30))]
    with pytest.raises(KeyError):
        refused.result(timeout=30)
    assert good.result(timeout=30).request_id == "good"
    outcomes = []
    for future in twice:
        try:
            outcomes.append(future.result(timeout=30).request_id)
        except ValueError as error:
            outcomes.append(str(error))
    assert outcomes[0] == "same" and "in flight already" in outcomes[1]
    assert loop.submit(request("after")).result(timeout=30).request_id == "after"  # still serving
    loop.close()


def test_close_fails_what_is_queued_or_in_flight_and_refuses_more():
    engine = SimEngine(TINY_CPU, 0, max_steps=1)
    loop = EngineLoop(engine)
    futures = [loop.submit(request(f"r{k}", tokens=50)) for k in range(20)]
    loop.close()
    assert all(future.done() for future in futures)  # none left waiting, however far the loop got
    for future in futures:  # each one finished before the close, or was failed by it
        try:
            assert future.result(timeout=0).finish_reason is not None
        except EngineLoopClosed:
            pass
    with pytest.raises(EngineLoopClosed):
        loop.submit(request("late"))
