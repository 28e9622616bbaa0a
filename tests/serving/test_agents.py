"""Agents written against the OpenAI API as environments (``reflow.serving.agents``), with a real vLLM engine,
the real endpoint and the real ``openai`` client (``tests/serving/scripts/agent_episodes.py`` says what each
part of the report is)."""

import json

from tests.conftest import run_torchrun


def test_agent_episodes_are_token_exact_and_failures_leave_nothing(tmp_path):
    out = tmp_path / "agents.json"
    run_torchrun(1, ["tests/serving/scripts/agent_episodes.py", str(out)])
    rep = json.loads(out.read_text())

    calc = rep["calc"]
    assert calc["finished"] == calc["most_in_flight"] == 64 and calc["synced"]
    assert calc["token_exact"] and calc["layouts"]  # the trained tokens are the returned ones, a version each
    assert calc["spanning_sync"] > 0  # episodes with tokens of both versions
    # a completions agent that sends its text back extends its tokens exactly, but after a turn with a special
    # token inside (which the API's text leaves out)
    assert calc["multi_turn"] > 0 and calc["mismatches"] <= calc["special_in_turns"]
    assert calc["failures"] == [""] and calc["rewards_as_builtin"] == 64
    for part in rep.values():
        if "engine_left" in part:
            assert part["engine_left"] == 0 and part["routes_left"] == 0, part

    chat = rep["chat"]
    assert chat["failures"] == [""] and chat["rewards"] == [1.0] and chat["calls"] == [2]
    # the tiny template closes a reply with a newline where the model sampled its EOS: the sampled tokens stay
    # and each second call counts its mismatch
    assert chat["mismatches"] == chat["finished"] == 4
    assert rep["status"]["chat_prompt_extends"] == [True] * 4 and rep["status"]["chat_logprobs"] == [1] * 4

    for agent, cause in (("raiser", "error"), ("sleeper", "timeout"), ("hog", "turn_budget")):
        assert rep[agent]["finished"] == 4 and rep[agent]["failures"] == [cause], (agent, rep[agent])
        assert rep[agent]["rewards"] == [0.0]

    assert rep["status"]["malformed"] == [[400, "n"], [400, "temperature"], [400, ["code", "message", "param", "type"]],
                                          [401, "invalid_api_key"]]
    assert rep["malformed"]["failures"] == [""] and rep["malformed"]["rewards"] == [1.0]  # the episode went on

    stop = rep["stop"]
    assert stop["dropped"] == 4 and stop["active_left"] == 0
    assert len(stop["refused"]) == 4 and set(stop["refused"]) <= {503, "cancelled"}
