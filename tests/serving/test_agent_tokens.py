"""How an agent's call extends its episode's trajectory (``AgentDriver._new_tokens``), on the tiny tokenizer with
Qwen3's chat template (vLLM ships it as MiniCPM-V 4.5's, whose language model is Qwen3): the sampled tokens
always stay; what a call adds is the context after them; a call that rewrites the conversation fails."""

import json
import os

import pytest
import vllm

from reflow.rollout.request import Request
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.serving.agents import AgentDriver, Episode, EpisodeFailed
from reflow.serving.chat import assistant_message, render
from reflow.serving.openai_api import Call
from tests.conftest import ROOT

QWEN3_TEMPLATE = os.path.join(os.path.dirname(vllm.__file__), "transformers_utils", "chat_templates",
                              "template_minicpmv45.jinja")
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]
NO_THINKING = "<think>\n\n</think>\n\n"
"""The opening of a turn with thinking off (this template's default)."""


class _Task:
    max_turns = 8


@pytest.fixture(scope="module")
def tokenizer():
    tok = PromptTokenizer(os.path.join(ROOT, "assets", "tiny-qwen3-tools"))
    tok.tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.tok.eos_token = "<|im_end|>"
    with open(QWEN3_TEMPLATE) as f:
        tok.tok.chat_template = f.read()
    return tok


def _driver(tokenizer) -> AgentDriver:
    # (the token logic needs neither the engine nor the agents' process)
    return AgentDriver(None, _Task(), tokenizer, None)


def _chat(messages, tokenizer, tools=TOOLS) -> Call:
    return Call(render(tokenizer.tok, messages, tools), None, "max_tokens", 1, 1.0, 1.0, (), None, messages=messages,
                tools=tools)


def _sampled(episode: Episode, tokenizer, text: str) -> None:
    """The model's turn: ``text`` sampled after the trajectory, as the engine appends it."""
    episode.turn_start = len(episode.request.output_ids)
    ids = tokenizer.tok(text, add_special_tokens=False).input_ids
    episode.request.append_model_tokens(ids, [0.0] * len(ids), 0)


def _decode(tokenizer, ids) -> str:
    return tokenizer.tok.decode(ids, skip_special_tokens=False)


def test_a_chat_agent_keeps_what_was_sampled_when_the_template_re_renders_it(tokenizer):
    driver = _driver(tokenizer)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    first = _chat(messages, tokenizer)
    episode = Episode("r", Request("a", list(first.prompt_ids), 200, seed=0), messages=[dict(m) for m in messages])
    # the model writes its tool call without the template's spaces: the re-rendered reply differs from it
    _sampled(episode, tokenizer, '<think>\nadd\n</think>\n\n<tool_call>\n{"name":"calculator","arguments":'
             '{"expression":"2+3"}}\n</tool_call><|im_end|>')
    reply = assistant_message(_decode(tokenizer, episode.request.output_ids[: -1]))
    assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == {"expression": "2+3"}
    messages = messages + [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"}]
    second = _chat(messages, tokenizer)
    sampled = episode.request.prompt_ids + episode.request.output_ids
    assert second.prompt_ids[: len(sampled)] != sampled  # a mismatch, not a token prefix
    added = driver._new_tokens(episode, second)
    # after the sampled end of turn: the template's newline, the tool's answer, the next turn's opening
    assert _decode(tokenizer, added) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" + NO_THINKING)
    assert episode.mismatches == 1

    # the next call: a final answer, then a new user message. Qwen3 drops the earlier turns' reasoning from
    # the rendered conversation; the trajectory keeps it as sampled and adds only the new messages
    episode.request.append_environment_tokens(added)
    episode.messages = [dict(m) for m in messages]
    _sampled(episode, tokenizer, "<think>\ndone\n</think>\n\n5<|im_end|>")
    messages = messages + [{"role": "assistant", "content": "<think>\ndone\n</think>\n\n5"},
                           {"role": "user", "content": "And 5+5?"}]
    third = _chat(messages, tokenizer)
    assert "add" not in _decode(tokenizer, third.prompt_ids)  # the template dropped the reasoning
    added = driver._new_tokens(episode, third)
    assert _decode(tokenizer, added) == "\n<|im_start|>user\nAnd 5+5?<|im_end|>\n<|im_start|>assistant\n" + NO_THINKING
    assert "<think>\nadd\n</think>" in _decode(tokenizer, episode.request.output_ids)


def test_a_chat_call_that_rewrites_the_conversation_fails_the_episode(tokenizer):
    driver = _driver(tokenizer)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    first = _chat(messages, tokenizer)
    episode = Episode("r", Request("a", list(first.prompt_ids), 200, seed=0), messages=[dict(m) for m in messages])
    _sampled(episode, tokenizer, "5<|im_end|>")
    edited = [{"role": "user", "content": "What is 2+4?"}, {"role": "assistant", "content": "5"},
              {"role": "user", "content": "Sure?"}]
    with pytest.raises(EpisodeFailed) as failed:
        driver._new_tokens(episode, _chat(edited, tokenizer))
    assert failed.value.cause == "diverged" and failed.value.error.status == 400


def _completion(tokenizer, text: str) -> Call:
    return Call(tokenizer.encode(text), None, "max_tokens", 1, 1.0, 1.0, ("</calc>",), None, text=text)


def _answered(episode: Episode, call: Call) -> None:
    """The turn answered to ``call``, as ``AgentDriver._answer`` keeps it."""
    req = episode.request
    episode.last_completion = (call, req.output_ids[episode.turn_start:], req.stop_reason)


def test_a_completion_agent_may_leave_out_the_stop_string(tokenizer):
    """The API's text ends before the stop string and leaves special tokens out; an agent that sends its text
    back so continues the trajectory, which keeps every sampled token, over as many calls as it makes; one
    that sends the stop string back extends the tokens exactly; one that rewrites its text fails."""
    driver = _driver(tokenizer)
    for sends_stop in (False, True):
        stop = "</calc>" if sends_stop else ""
        first = _completion(tokenizer, "Calc: 3+5+1=")
        episode = Episode("r", Request("a", list(first.prompt_ids), 200, seed=0, stop=("</calc>",)))
        _sampled(episode, tokenizer, "<calc>3+5</calc>")
        episode.request.stop_reason = "</calc>"
        _answered(episode, first)
        second = _completion(tokenizer, "Calc: 3+5+1=<calc>3+5" + stop + "<result>8</result>\n")
        added = driver._new_tokens(episode, second)
        assert _decode(tokenizer, added) == "<result>8</result>\n"
        assert episode.mismatches == (0 if sends_stop else 1)
        episode.request.append_environment_tokens(added)
        # the second turn: a special token inside it (the API's text leaves it out), and the stop string again
        _sampled(episode, tokenizer, "<calc>8<|bos|>+1</calc>")
        episode.request.stop_reason = "</calc>"
        _answered(episode, second)
        third = _completion(tokenizer, "Calc: 3+5+1=<calc>3+5" + stop + "<result>8</result>\n<calc>8+1" + stop
                            + "<result>9</result>\n")
        added = driver._new_tokens(episode, third)
        assert _decode(tokenizer, added) == "<result>9</result>\n"
        assert "<calc>8<|bos|>+1</calc>" in _decode(tokenizer, episode.request.output_ids)  # as sampled
        assert episode.mismatches == (1 if sends_stop else 2)
        rewritten = _completion(tokenizer, "Calc: 3+5+1=<calc>4+4<result>8</result>")
        with pytest.raises(EpisodeFailed):
            driver._new_tokens(episode, rewritten)
