"""``python -m reflow.serve``: the tiny model behind the OpenAI-compatible endpoint, driven by the real ``openai``
client (and by raw HTTP for what a client library would refuse to send). One server for the module: a real
vLLM engine on CPU, on a free loopback port, with a key from its key file."""

import asyncio
import os
import re
import signal
import stat
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from reflow.serving.chat import assistant_message
from tests.conftest import ROOT, TINY_HF

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, its key, and its stderr (read on a thread all along: a full pipe would stall it). At the end
    SIGTERM must end it cleanly, with exit code 0."""
    key_file = tmp_path_factory.mktemp("serve") / "key"
    env = {k: v for k, v in os.environ.items() if k != "REFLOW_API_KEY"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "reflow.serve", "--hf", TINY_HF, "--port", "0", "--api-key-file", str(key_file)],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    listening = threading.Event()

    def drain():
        for line in proc.stderr:
            lines.append(line)
            if re.search(r"reflow\.serve: \S+ at http://\S+/v1", line):
                listening.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert listening.wait(timeout=300), "".join(lines[-20:])
    url = re.search(r"at (http://\S+/v1)", next(line for line in lines if " at http://" in line)).group(1)
    yield {"url": url, "key": key_file.read_text().strip(), "key_file": key_file, "log": lines}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "".join(lines[-20:])
    reader.join(timeout=10)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"], api_key=server["key"], max_retries=0, timeout=120)


def test_the_key_is_the_runs_own_and_never_printed(server):
    assert stat.S_IMODE(os.stat(server["key_file"]).st_mode) == 0o600
    assert len(server["key"]) >= 32 and server["key"] not in "".join(server["log"])
    assert server["url"].startswith("http://127.0.0.1:")  # loopback unless --host says otherwise
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"], api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client(server).models.list().data] == [MODEL]


def test_completions_return_the_sampled_tokens_with_their_logprobs_and_honor_seed_n_and_stop(server):
    api = client(server)
    out = api.completions.create(model=MODEL, prompt="3+4+5=", max_tokens=12, n=3, seed=7, logprobs=1, temperature=1.0)
    assert len(out.choices) == 3 and out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
    extra = out.model_extra
    bos = AutoTokenizer.from_pretrained(TINY_HF).bos_token_id
    assert extra["prompt_token_ids"][0] == bos and out.usage.prompt_tokens == len(extra["prompt_token_ids"])  # as training
    for choice in out.choices:
        assert len(choice.logprobs.token_logprobs) == len(choice.token_ids) <= 12
        assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
        assert choice.finish_reason in ("stop", "length")
    # the same seed samples the same completions (each of the n with its own seed: seed + index)
    again = api.completions.create(model=MODEL, prompt="3+4+5=", max_tokens=12, n=3, seed=7)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]
    # a stop string ends the completion: the text leaves it out, the tokens keep it (one token per character)
    greedy = api.completions.create(model=MODEL, prompt="3+4+5=", max_tokens=12, temperature=0.0).choices[0]
    assert len(greedy.text) >= 2, greedy
    cut = greedy.text.index(greedy.text[1])
    stopped = api.completions.create(model=MODEL, prompt="3+4+5=", max_tokens=12, temperature=0.0,
                                     stop=[greedy.text[1]]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (greedy.text[:cut], "stop")
    assert stopped.token_ids == greedy.token_ids[: cut + 1]


def test_chat_completions_render_the_template_and_run_concurrently(server):
    api = client(server)
    out = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2="}], max_tokens=8,
                                      logprobs=True, seed=3)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    template = AutoTokenizer.from_pretrained(TINY_HF).apply_chat_template(
        [{"role": "user", "content": "2+2="}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.model_extra["prompt_token_ids"] == list(template)

    async def many():
        concurrent = openai.AsyncOpenAI(base_url=server["url"], api_key=server["key"], max_retries=0, timeout=120)
        return await asyncio.gather(*(
            concurrent.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"{k}+1="}],
                                               max_tokens=6, seed=k)
            for k in range(8)
        ))

    assert all(len(r.choices) == 1 for r in asyncio.run(many()))


def test_bad_requests_get_the_openai_error_shape_before_the_engine(server):
    api = client(server)
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="gpt-4", prompt="1=", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as long:
        api.completions.create(model=MODEL, prompt="1=", max_tokens=10_000)
    assert long.value.body["code"] == "context_length_exceeded" and long.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as streaming:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1="}], stream=True)
    assert streaming.value.body["param"] == "stream"
    raw = httpx.post(f"{server['url']}/completions", json={"model": MODEL, "max_tokens": 2},
                     headers={"Authorization": f"Bearer {server['key']}"}, timeout=60)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    headers = {"Authorization": f"Bearer {server['key']}"}
    for body, param in (
        ({"model": MODEL, "prompt": "1=", "stop": [""]}, "stop"),  # vLLM would refuse it inside the engine
        ({"model": MODEL, "prompt": [1, 10**6]}, "prompt"),  # a token id the model does not have
        ({"model": MODEL, "prompt": "1=", "echo": True}, "echo"),  # not served: refused, not ignored
        ({"model": MODEL, "prompt": "1=", "seed": 2**64}, "seed"),
    ):
        refused = httpx.post(f"{server['url']}/completions", json=body, headers=headers, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    unknown = httpx.get(f"{server['url']}/embeddings", headers=headers, timeout=60)
    assert unknown.status_code == 404 and "error" in unknown.json()
    # null means the default, as clients send it; and the server still serves after every refusal
    served = httpx.post(f"{server['url']}/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, "temperature": None,
        "top_p": None, "n": None, "logprobs": None, "stream": None,
    })
    assert served.status_code == 200 and len(served.json()["choices"]) == 1


def test_a_bad_folder_is_one_line_before_any_engine(tmp_path):
    done = subprocess.run([sys.executable, "-m", "reflow.serve", "--hf", str(tmp_path / "missing")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--hf" in done.stderr


def test_tool_calls_are_read_as_qwen3_templates_write_them():
    message = assistant_message(
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert message["content"] == "Let me add.<tool_call>not json</tool_call>"  # what is no call stays as written
    assert assistant_message("42") == {"role": "assistant", "content": "42"}
