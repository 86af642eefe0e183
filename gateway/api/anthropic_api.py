"""Anthropic's Messages API, POST /v1/messages, served as a chat completion.

The request becomes a chat completions body (`to_chat`): `system` (a string or text blocks) the first
message; user blocks `text` and `tool_result` (a `tool` message each), assistant blocks `text`,
`tool_use` (its `tool_calls`) and `thinking`; `tools` (`input_schema` as the function's parameters)
and `tool_choice` (auto, any -> "required", tool -> a named function, none; `disable_parallel_tool_use`
-> parallel_tool_calls false), `stop_sequences`, `max_tokens`, `temperature`, `top_p`, `top_k`.
It then runs the chat pipeline as it is (tools prompt, grammar for a forced tool, reasoning and
tool-call parsers); anthropic_reply.py shapes the answer and its stream. Errors have Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}`, whoever raises them (errors.error_body_for);
its clients' `x-api-key` header is taken as the API key (auth.py).

What Anthropic refuses is a 400 here too: a conversation not opening with a user turn, a tool_use
without an id or name (or an id used twice), a tool_result whose tool_use_id no tool_use of the
message before it carries, two tools of one name, `thinking` enabled with a budget under 1024 tokens
or not under max_tokens. Thinking blocks of earlier assistant turns are taken (the chat template
keeps or drops them, as Anthropic strips them for models that do not think), but their characters
count toward the prompt's length cap like every other text of the request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from pdserve.gateway.api.anthropic_reply import message_from_chat, message_stream
from pdserve.gateway.api.openai_api import serve_chat_as
from pdserve.gateway.api.state import gateway_state
from pdserve.gateway.errors import bad_request
from pdserve.gateway.protocol import parse_body
from pdserve.gateway.request_models import LenientModel
from pdserve.json_types import Json

router = APIRouter()


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


class ThinkingConfig(LenientModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


# Anthropic's floor for an extended-thinking budget.
MIN_THINKING_BUDGET = 1024


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
    thinking: ThinkingConfig | None = None
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


def _user(m: Message, at: str, calls: set[str]) -> list[Json]:
    """A user message: its tool results as `tool` messages, then its text (if any) as one message.
    `calls`: the tool_use ids of the message before it, the only ones a tool_result may answer."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[Json] = []
    texts = []
    for i, b in enumerate(m.content):
        if b.type == "tool_result":
            if not b.tool_use_id:
                raise bad_request("a tool_result block needs tool_use_id", f"{at}.content.{i}.tool_use_id")
            if b.tool_use_id not in calls:
                raise bad_request(
                    f"unexpected tool_use_id found in tool_result blocks: {b.tool_use_id}. Each tool_result "
                    "block must have a corresponding tool_use block in the previous message",
                    f"{at}.content.{i}.tool_use_id",
                )
            content = _text(b.content, f"{at}.content.{i}.content")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif b.type == "text" and b.text is not None:
            texts.append(b.text)
        else:
            raise bad_request(f"a '{b.type}' block is not supported in a user message", f"{at}.content.{i}")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_use(b: Block, at: str, seen: set[str]) -> Json:
    """A tool_use block as a chat tool call; its id must be there and new (`seen`: the ids so far)."""
    if not b.id:
        raise bad_request("a tool_use block needs an id", f"{at}.id")
    if not b.name:
        raise bad_request("a tool_use block needs a name", f"{at}.name")
    if b.id in seen:
        raise bad_request(f"tool_use ids must be unique: {b.id} is used twice", f"{at}.id")
    seen.add(b.id)
    args = json.dumps(b.input or {}, ensure_ascii=False)
    return {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}}


def _assistant(m: Message, at: str, seen: set[str]) -> Json:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    texts, calls, thought = [], [], []
    for i, b in enumerate(m.content):
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_use":
            calls.append(_tool_use(b, f"{at}.content.{i}", seen))
        elif b.type == "thinking":
            if b.thinking is None:
                raise bad_request("a thinking block needs its thinking text", f"{at}.content.{i}.thinking")
            thought.append(b.thinking)
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


def _messages(body: MessagesBody) -> list[Json]:
    """The conversation as chat messages: it opens with a user turn; tool ids are checked."""
    if body.messages[0].role != "user":
        raise bad_request('the first message must use the "user" role', "messages.0.role")
    msgs: list[Json] = []
    if body.system:
        msgs.append({"role": "system", "content": _text(body.system, "system")})
    seen: set[str] = set()  # every tool_use id so far
    calls: set[str] = set()  # those of the message before
    for i, m in enumerate(body.messages):
        if m.role == "user":
            msgs += _user(m, f"messages.{i}", calls)
            calls = set()
        else:
            msgs.append(_assistant(m, f"messages.{i}", seen))
            calls = {c["id"] for c in msgs[-1].get("tool_calls", [])}
    return msgs


def _check_chars(msgs: list[Json], max_chars: int | None) -> None:
    """Every text of the conversation, the thinking of earlier turns included (which the template may
    drop), within the characters the context can hold: a 1 MB thinking block is refused, not dropped
    unseen."""
    if max_chars is None:
        return
    n = sum(
        len(m.get("content") or "")
        + len(m.get("reasoning_content") or "")
        + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
        for m in msgs
    )
    if n > max_chars:
        raise bad_request(
            f"the messages have {n} characters (thinking blocks included), more than the context "
            f"length can hold ({max_chars} characters at most)",
            "messages",
        )


def _check_request(body: MessagesBody) -> None:
    """What Anthropic refuses outside the messages: tool names twice, a thinking budget out of range."""
    names = [t.name for t in body.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tool names must be unique: {name!r} is used twice", f"tools.{i}.name")
    t = body.thinking
    if t is not None and t.type == "enabled":
        if t.budget_tokens is None:
            raise bad_request("thinking of type 'enabled' needs budget_tokens", "thinking.budget_tokens")
        if t.budget_tokens < MIN_THINKING_BUDGET:
            raise bad_request(
                f"budget_tokens must be at least {MIN_THINKING_BUDGET}", "thinking.budget_tokens"
            )
        if t.budget_tokens >= body.max_tokens:
            raise bad_request(
                f"max_tokens ({body.max_tokens}) must be greater than thinking.budget_tokens "
                f"({t.budget_tokens})",
                "thinking.budget_tokens",
            )


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


def to_chat(raw: Json, max_chars: int | None = None) -> Json:
    """A Messages request body as a chat completions body; `max_chars`: the characters the context
    can hold (None: unchecked here)."""
    body = parse_body(MessagesBody, raw)
    _check_request(body)
    msgs = _messages(body)
    _check_chars(msgs, max_chars)
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
    if body.thinking is not None and body.thinking.type == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    return chat


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    # Errors, raised here or by the limits before, take Anthropic's shape by path (errors.py).
    gw = gateway_state(request)
    context = gw.registry.context_length()
    max_chars = context * gw.tokenizer.max_token_chars if context is not None else None
    return await serve_chat_as(
        request, lambda raw: to_chat(raw, max_chars), message_from_chat, message_stream
    )
