"""Anthropic's Messages API, POST /v1/messages, served as a chat completion.

The request becomes a chat completions body (`to_chat`): `system` (a string or text blocks) the first
message; user blocks `text` and `tool_result` (a `tool` message each), assistant blocks `text`,
`tool_use` (its `tool_calls`) and `thinking`; `tools` (`input_schema` as the function's parameters)
and `tool_choice` (auto, any -> "required", tool -> a named function, none; `disable_parallel_tool_use`
-> parallel_tool_calls false), `stop_sequences`, `max_tokens`, `temperature`, `top_p`, `top_k`.
It then runs the chat pipeline as it is (tools prompt, grammar for a forced tool, reasoning and
tool-call parsers); anthropic_reply.py shapes the answer and its stream. Errors have Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}`; its clients' `x-api-key` header is taken as
the API key (auth.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from pdserve.gateway.anthropic_reply import error_body, message_from_chat, message_stream
from pdserve.gateway.errors import ApiError, bad_request
from pdserve.gateway.openai_api import serve_chat_as
from pdserve.gateway.protocol import parse_body
from pdserve.gateway.request_models import LenientModel

router = APIRouter()
Json = dict[str, Any]


class Block(LenientModel):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False
    thinking: str | None = None
    signature: str | None = None


class Message(LenientModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(LenientModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search...) are not served


class AnthropicToolChoice(LenientModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesBody(LenientModel):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _text(content: str | list[Block] | None, param: str) -> str:
    """Text blocks (or a string) as one text; any other block here is a 400."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for b in content:
        if b.type != "text" or b.text is None:
            raise bad_request(f"a '{b.type}' block is not supported here: only text blocks are", param)
        parts.append(b.text)
    return "\n".join(parts)


def _user(m: Message, at: str) -> list[Json]:
    """A user message: its tool results as `tool` messages, then its text (if any) as one message."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[Json] = []
    texts = []
    for i, b in enumerate(m.content):
        if b.type == "tool_result":
            if not b.tool_use_id:
                raise bad_request("a tool_result block needs tool_use_id", f"{at}.content.{i}")
            content = _text(b.content, f"{at}.content.{i}.content")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif b.type == "text" and b.text is not None:
            texts.append(b.text)
        else:
            raise bad_request(f"a '{b.type}' block is not supported in a user message", f"{at}.content.{i}")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(m: Message, at: str) -> Json:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    texts, calls, thought = [], [], []
    for i, b in enumerate(m.content):
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_use" and b.name:
            args = json.dumps(b.input or {}, ensure_ascii=False)
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}})
        elif b.type == "thinking":
            thought.append(b.thinking or "")
        elif b.type != "redacted_thinking":
            raise bad_request(
                f"a '{b.type}' block is not supported in an assistant message", f"{at}.content.{i}"
            )
    msg: Json = {"role": "assistant", "content": "\n".join(texts) or None}
    if calls:
        msg["tool_calls"] = calls
    if thought:
        msg["reasoning_content"] = "\n".join(thought)
    return msg


def _tool_choice(body: MessagesBody) -> tuple[Any, bool]:
    """(chat tool_choice, parallel_tool_calls)."""
    tc = body.tool_choice
    if tc is None:
        return None, True
    parallel = not tc.disable_parallel_tool_use
    if tc.type == "tool":
        if not tc.name:
            raise bad_request("tool_choice of type 'tool' needs a name", "tool_choice.name")
        return {"type": "function", "function": {"name": tc.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[tc.type], parallel


def to_chat(raw: Json) -> Json:
    """A Messages request body as a chat completions body."""
    body = parse_body(MessagesBody, raw)
    msgs: list[Json] = []
    if body.system:
        msgs.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        msgs += _user(m, f"messages.{i}") if m.role == "user" else [_assistant(m, f"messages.{i}")]
    tool_choice, parallel = _tool_choice(body)
    chat: Json = {
        "model": body.model,
        "messages": msgs,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    if body.thinking is not None and body.thinking.get("type") == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    return chat


def error_response(e: ApiError) -> Response:
    return JSONResponse(error_body(e.status, e.message), status_code=e.status, headers=e.headers)


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    try:
        return await serve_chat_as(request, to_chat, message_from_chat, message_stream)
    except ApiError as e:
        return error_response(e)
