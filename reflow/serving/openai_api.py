"""An OpenAI-compatible HTTP API over a generation backend: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``, in OpenAI's request and response shapes (FastAPI; the server is
``reflow.serving.server``).

    app = build_app(ServedModel(loop, tokenizer, "tiny", max_model_len=256), api_key="...")   # a checkpoint
    app = build_app(episode_backend, api_key="...")         # agent episodes of a run (reflow.serving.agent_host)

The API parses and checks a call into a ``Call`` (the prompt's tokens, and the messages or text they came
from) and asks its backend for the completions: ``ServedModel`` samples them on an ``EngineLoop``; a run's
``EpisodeBackend`` (in the agents' process) sends them to the episode's driver, which adds them to the
episode's trajectory. Each backend is served under its routes: a
checkpoint at ``/v1/...``, an episode at ``/episodes/<episode>/v1/...`` (the base URL its agent's client has).

Every request needs ``Authorization: Bearer <api_key>``. A malformed request, an unknown model, a prompt that
does not fit the context or an option this server does not serve (streaming, alternatives' log-probs)
gets OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, with a 4xx status, before anything
reaches the engine; so does a request with an option this server would otherwise ignore (``echo``,
``best_of`` above 1, ``logit_bias``, penalties, ``response_format``, a forced ``tool_choice``). Each response
also carries the exact tokens: ``prompt_token_ids`` (beside the choices) and each choice's ``token_ids``
(every token sampled, the stop string's included), so a caller can train on exactly what was sampled rather
than on text re-tokenized.

Sampling: ``temperature`` and ``top_p`` are the request's own (defaults 1.0); ``n`` completions of one
prompt are sampled with seeds ``seed``, ``seed`` + 1, ... (a random ``seed`` when the request has none);
``stop`` strings end a completion (the text leaves the stop string out; ``token_ids`` keep every token
sampled); ``logprobs`` report each sampled token's log-probability.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from reflow.rollout.request import Request as EngineRequest
from reflow.rollout.tokenizer import PromptTokenizer
from reflow.serving.chat import assistant_message, render
from reflow.serving.engine_loop import EngineLoop


@dataclass
class Call:
    """One API call's generation, parsed and checked."""

    prompt_ids: list[int]
    """The prompt's tokens: the rendered messages, the encoded text, or the token ids sent."""
    max_tokens: int | None
    """Tokens to generate at most (checked >= 1); None: as many as fit."""
    max_tokens_param: str
    """The request field that set it (for errors)."""
    n: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    messages: list[dict] | None = None
    """A chat call's messages (and ``tools``); None for a completion."""
    tools: list[dict] | None = None
    text: str | None = None
    """A completion's text prompt; None for token ids or a chat call."""


@dataclass
class Completion:
    """One sampled completion of a call: the prompt its tokens continue, and its tokens."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: str | int | None


class Backend(Protocol):
    name: str
    max_model_len: int
    tokenizer: PromptTokenizer
    """The model's tokenizer as training uses it (a text prompt gets BOS first); ``.tok``, the Hugging Face one,
    has the chat template."""

    async def generate(self, route: str | None, call: Call) -> list[Completion]:
        """``call.n`` completions of ``call`` under ``route`` (None: ``/v1``; else ``/episodes/<route>/v1``), in
        order; raises ``OpenAIError`` for what it cannot serve."""
        ...


@dataclass
class ServedModel:
    """A checkpoint served at ``/v1`` on its ``EngineLoop``: each call's completions sampled independently."""

    loop: EngineLoop
    tokenizer: PromptTokenizer
    name: str
    max_model_len: int

    async def generate(self, route: str | None, call: Call) -> list[Completion]:
        if route is not None:
            raise OpenAIError(404, "this server serves the model at /v1 only", None, "not_found")
        limit = check_max_tokens(call, len(call.prompt_ids), self.max_model_len)
        seed = call.seed if call.seed is not None else secrets.randbelow(2**31)
        base = uuid.uuid4().hex
        futures = [
            self.loop.submit(EngineRequest(
                f"api-{base}-{k}", list(call.prompt_ids), limit, seed=seed + k, stop=call.stop,
                temperature=call.temperature, top_p=call.top_p,
            ))
            for k in range(call.n)
        ]
        done = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return [Completion(list(call.prompt_ids), r.output_ids, r.logprobs, r.finish_reason, r.stop_reason) for r in done]


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
        )


class _Sampling(BaseModel):
    """The fields both APIs share; null stands for the default, as OpenAI's clients send it."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None


class CompletionBody(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None


class ChatBody(_Sampling):
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


SEED_LIMIT = 2**63 - 256
"""Seeds (with their n - 1 successors) must fit the engine's 64-bit generator."""

UNSERVED = {
    "echo": lambda v: bool(v), "best_of": lambda v: v not in (None, 1), "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0, 0.0), "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "response_format": lambda v: v not in (None, {"type": "text"}), "suffix": lambda v: bool(v),
}
"""Options this server does not serve, and when a value asks for them: refused rather than ignored."""


def _check_sampling(body: _Sampling, model: Backend) -> None:
    """Refuse what cannot be served, then fill in the defaults of what was null."""
    if body.model != model.name:
        raise OpenAIError(404, f"The model `{body.model}` does not exist; this server serves `{model.name}`", "model",
                          "model_not_found")
    if body.stream:
        raise OpenAIError(400, "stream: this server answers whole responses only; send stream=false", "stream")
    for name, value in (body.model_extra or {}).items():
        if name in UNSERVED and UNSERVED[name](value):
            raise OpenAIError(400, f"{name}: this server does not serve it; leave it out", name)
    body.n = 1 if body.n is None else body.n
    body.temperature = 1.0 if body.temperature is None else body.temperature
    body.top_p = 1.0 if body.top_p is None else body.top_p
    if not 1 <= body.n <= 128:
        raise OpenAIError(400, f"n must be in [1, 128], got {body.n}", "n")
    if not 0.0 <= body.temperature <= 2.0:
        raise OpenAIError(400, f"temperature must be in [0, 2], got {body.temperature}", "temperature")
    if not 0.0 < body.top_p <= 1.0:
        raise OpenAIError(400, f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
        raise OpenAIError(400, f"seed must be in [0, 2**63 - 256), got {body.seed}", "seed")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not stop for stop in stops) or len(stops) > 4:
        raise OpenAIError(400, "stop: up to 4 strings, none of them empty", "stop")


def check_max_tokens(call: Call, prompt_len: int, max_model_len: int) -> int:
    """The tokens ``call`` may generate after a prompt of ``prompt_len`` tokens in a context of ``max_model_len``."""
    room = max_model_len - prompt_len
    param = "messages" if call.messages is not None else "prompt"
    if room <= 0:
        raise OpenAIError(400, f"the prompt has {prompt_len} tokens; this model's context is {max_model_len}",
                          param, "context_length_exceeded")
    if call.max_tokens is None:
        return room
    if call.max_tokens > room:
        raise OpenAIError(400, f"{call.max_tokens_param} = {call.max_tokens} does not fit: the prompt has {prompt_len} "
                          f"tokens and the context {max_model_len}", call.max_tokens_param, "context_length_exceeded")
    return call.max_tokens


def _call(body: _Sampling, prompt_ids: list[int], requested: int | None, param: str, **source) -> Call:
    if requested is not None and requested < 1:
        raise OpenAIError(400, f"{param} must be at least 1, got {requested}", param)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return Call(prompt_ids, requested, param, body.n, body.temperature, body.top_p, stop, body.seed, **source)


def completion_text(tokenizer, output_ids: list[int], stop_reason) -> str:
    """A completion's text as the API returns it: special tokens left out, and cut before its stop string (vLLM
    stops at the first match, inside the last token: the text leaves it and whatever that token held after it
    out; ``token_ids`` keep every token)."""
    text = tokenizer.tok.decode(output_ids, skip_special_tokens=True)
    if isinstance(stop_reason, str) and stop_reason in text:
        text = text[: text.index(stop_reason)]
    return text


def _text(model: Backend, done: Completion) -> str:
    return completion_text(model.tokenizer, done.output_ids, done.stop_reason)


def _token_texts(model: Backend, ids: list[int]) -> list[str]:
    """Each token's own text (a byte-level token's decoded form, not its vocabulary spelling; "" for an id the
    tokenizer does not know)."""
    known = len(model.tokenizer.tok)
    return [model.tokenizer.tok.decode([i]) if i < known else "" for i in ids]


def _usage(done: list[Completion]) -> dict:
    prompt = len(done[0].prompt_ids) if done else 0
    completion = sum(len(r.output_ids) for r in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class KeyCheck:
    """Every request needs ``Authorization: Bearer <api_key>``. A plain ASGI middleware: FastAPI's ``http``
    middleware runs each request through a task group and memory streams of its own, which cost more of the
    agents' process's time per call than the parsing itself."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = OpenAIError(401, "Incorrect API key provided", None, "invalid_api_key").response()
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(model: Backend, api_key: str) -> FastAPI:
    app = FastAPI(title="ReFlow OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _malformed(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return OpenAIError(400, f"malformed request: {first.get('msg', 'invalid body')}", param).response()

    @app.exception_handler(Exception)
    async def _failed(request: Request, error: Exception):  # the engine's error (every request gets it), or a bug
        return OpenAIError(500, f"the server could not answer: {type(error).__name__}", None, "server_error",
                           "server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):  # unknown paths and methods
        return OpenAIError(error.status_code, str(error.detail), None, None).response()

    app.add_middleware(KeyCheck, api_key=api_key)

    @app.get("/v1/models")
    @app.get("/episodes/{route}/v1/models")
    async def models(route: str | None = None):
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "reflow"}]}

    @app.post("/v1/completions")
    @app.post("/episodes/{route}/v1/completions")
    async def completions(body: CompletionBody, route: str | None = None):
        _check_sampling(body, model)
        if body.logprobs is not None and body.logprobs > 1:
            raise OpenAIError(400, "logprobs: this server reports the sampled token's log-probability only (0 or 1)",
                              "logprobs")
        prompt_ids = list(body.prompt) if isinstance(body.prompt, list) else model.tokenizer.encode(body.prompt)
        if not prompt_ids:
            raise OpenAIError(400, "prompt is empty", "prompt")
        vocabulary = len(model.tokenizer.tok)
        if any(not 0 <= i < vocabulary for i in prompt_ids):
            raise OpenAIError(400, f"prompt: token ids must be in [0, {vocabulary})", "prompt")
        call = _call(body, prompt_ids, body.max_tokens, "max_tokens",
                     text=body.prompt if isinstance(body.prompt, str) else None)
        done = await model.generate(route, call)
        choices = []
        for index, r in enumerate(done):
            logprobs = None
            if body.logprobs is not None:
                tokens = _token_texts(model, r.output_ids)
                logprobs = {"tokens": tokens, "token_logprobs": list(r.logprobs),
                            "top_logprobs": [{t: lp} for t, lp in zip(tokens, r.logprobs)], "text_offset": None}
            choices.append({"index": index, "text": _text(model, r), "logprobs": logprobs,
                            "finish_reason": r.finish_reason, "stop_reason": r.stop_reason,
                            "token_ids": list(r.output_ids)})
        # (a response, not a dict: FastAPI would walk a dict through its encoder, item by item of every token list)
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                             "created": int(time.time()), "model": model.name, "choices": choices,
                             "usage": _usage(done), "prompt_token_ids": done[0].prompt_ids})

    @app.post("/v1/chat/completions")
    @app.post("/episodes/{route}/v1/chat/completions")
    async def chat_completions(body: ChatBody, route: str | None = None):
        _check_sampling(body, model)
        if body.top_logprobs:
            raise OpenAIError(400, "top_logprobs: this server reports the sampled token's log-probability only",
                              "top_logprobs")
        if not body.messages:
            raise OpenAIError(400, "messages is empty", "messages")
        if body.tool_choice not in (None, "auto", "none"):
            raise OpenAIError(400, "tool_choice: this server lets the model choose ('auto' or 'none')", "tool_choice")
        try:
            prompt_ids = render(model.tokenizer.tok, body.messages, body.tools)
        except (ValueError, TypeError, KeyError, TemplateError) as error:  # the template's complaints
            raise OpenAIError(400, f"messages: {error}", "messages") from error
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        done = await model.generate(route, _call(body, prompt_ids, requested, param, messages=body.messages,
                                                 tools=body.tools))
        choices = []
        for index, r in enumerate(done):
            message = assistant_message(_text(model, r))
            finish = "tool_calls" if message.get("tool_calls") and r.finish_reason == "stop" else r.finish_reason
            logprobs = None
            if body.logprobs:
                tokens = _token_texts(model, r.output_ids)
                logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                        for t, lp in zip(tokens, r.logprobs)]}
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                            "stop_reason": r.stop_reason, "token_ids": list(r.output_ids)})
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                             "created": int(time.time()), "model": model.name, "choices": choices,
                             "usage": _usage(done), "prompt_token_ids": done[0].prompt_ids})

    return app
