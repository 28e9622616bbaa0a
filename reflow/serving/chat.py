"""Chat messages to prompt tokens, and a completion's text back to an assistant message.

``render`` applies the model's own chat template (the tokenizer's, with the request's tools), ending with the
assistant's opening, so the completion is the assistant's message. ``assistant_message`` reads a completion
as Qwen3-style templates write tool calls: each call a JSON object {"name": ..., "arguments": {...}} between
``<tool_call>`` and ``</tool_call>``; the text outside the calls is the message's content. A block that is not
such an object stays in the content (the caller sees what the model wrote; nothing is dropped).
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt tokens of ``messages`` (and ``tools``) under the tokenizer's chat template."""
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template: use /v1/completions with a text prompt")
    kwargs = {"tools": tools} if tools else {}
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                              **kwargs))


def render_text(tokenizer, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True) -> str:
    """The text of ``messages`` under the chat template (with the assistant's opening when ``generation_prompt``)."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)


def assistant_message(text: str) -> dict:
    """The assistant message of a completion's ``text``: its content and the tool calls it made (OpenAI's
    shapes: each call's arguments a JSON string)."""
    calls, kept = [], []
    last = 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        arguments = call.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
    kept.append(text[last:])
    content = "".join(kept).strip()
    message: dict = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return message
