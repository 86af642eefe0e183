"""Anthropic's Messages answers from the chat pipeline's: the whole `message` object from a
chat.completion (`message_from_chat`), and the typed event stream from its chunk objects
(`message_stream`): message_start, ping, then per content block content_block_start, its deltas
(thinking_delta, text_delta, input_json_delta) and content_block_stop, then message_delta (stop_reason,
usage) and message_stop; a failure mid-stream ends it with an `error` event.
Content blocks come in the order the chat parsers release them: thinking, text, tool_use.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from pdserve.gateway.errors import ApiError, anthropic_error_body
from pdserve.gateway.generation.generation import GenInput
from pdserve.json_types import Json


def stop_reason(finish: str | None, matched: Any) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and matched_stop."""
    if finish is None:
        return None, None
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _input(arguments: str) -> Json:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(u: Json | None) -> Json:
    u = u or {}
    return {
        "input_tokens": u.get("prompt_tokens", 0),
        "output_tokens": u.get("completion_tokens", 0),
        "cache_read_input_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call: Json) -> Json:
    fn = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn["arguments"])}


def message_from_chat(chat: Json) -> Json:
    """The Messages answer of a (one-choice) chat.completion object."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[Json] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [_tool_use(c) for c in msg.get("tool_calls") or []]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("matched_stop"))
    return {
        "id": f"msg_{chat['id']}",
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(chat.get("usage")),
    }


def _event(kind: str, data: Json) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class _Blocks:
    """The content blocks of a stream: which one is open, and the events that open, fill and close them."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _start(self, kind: str, block: Json) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        return [*out, _event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: Json) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, delta: Json) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            block = {**_tool_use(call), "input": {}}
            out += self._start("tool_use", block)
            out.append(
                self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
            )
        return out


async def message_stream(
    events: AsyncGenerator[Json | ApiError, None], inputs: list[GenInput]
) -> AsyncGenerator[bytes, None]:
    """The Messages event stream of a (one-choice) chat request's chunk objects."""
    blocks = _Blocks()
    finish: tuple[str | None, str | None] = (None, None)
    usage: Json = {"prompt_tokens": len(inputs[0].input_ids)}
    started = False
    async for ev in events:
        if isinstance(ev, ApiError):
            yield _event("error", {"error": anthropic_error_body(ev.status, ev.message, ev.param)["error"]})
            return
        if not started:
            started = True
            message = {
                **message_from_chat(
                    {
                        "id": ev["id"],
                        "model": ev["model"],
                        "choices": [{"message": {}, "finish_reason": None}],
                    }
                ),
                "usage": {**_usage(usage), "output_tokens": 0},
            }
            yield _event("message_start", {"message": message})
            yield _event("ping", {})
        if not ev["choices"]:
            usage = ev["usage"] or usage
            continue
        choice = ev["choices"][0]
        for b in blocks.feed(choice["delta"]):
            yield b
        if choice["finish_reason"] is not None:
            finish = stop_reason(choice["finish_reason"], choice.get("matched_stop"))
    for b in blocks.close():
        yield b
    delta = {"stop_reason": finish[0], "stop_sequence": finish[1]}
    yield _event(
        "message_delta", {"delta": delta, "usage": {"output_tokens": _usage(usage)["output_tokens"]}}
    )
    yield _event("message_stop", {})
