"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, served as a chat
completion.

The request becomes a chat completions body (`_Turn.to_chat`): `instructions` the system message;
`input` a string (one user message) or items: messages (input_text / output_text parts), `function_call`
(an assistant message's tool call) and `function_call_output` (a `tool` message); `reasoning` items are
skipped. `tools` (function tools only) and `tool_choice`, `parallel_tool_calls`, `text.format`
(json_object, json_schema: enforced by the grammar backend as response_format), `reasoning.effort`,
`max_output_tokens`, `temperature`, `top_p`. With `previous_response_id`, the stored conversation up
to that response comes first (its instructions are not carried over, as OpenAI does).
responses_models.py holds the body's shape (and what the answer may repeat of it), responses_reply.py
shapes the answer and its stream; responses_store.py keeps what `store` asks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.gateway.api.openai_api import serve_chat_as
from pdserve.gateway.api.responses_models import InputItem, NamedFunction, Part, ResponsesBody, TextConfig
from pdserve.gateway.api.responses_reply import ResponseStream, output_items, response_object
from pdserve.gateway.api.responses_store import ResponseStore, owner_of
from pdserve.gateway.api.serving import sse
from pdserve.gateway.api.state import gateway_state
from pdserve.gateway.errors import ApiError, bad_request
from pdserve.gateway.generation.generation import GenInput
from pdserve.gateway.protocol import parse_body
from pdserve.json_types import Json

router = APIRouter()


def _text(content: str | list[Part] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for i, p in enumerate(content):
        if p.type not in ("input_text", "output_text", "text") or p.text is None:
            raise bad_request(
                f"a '{p.type}' content part is not supported: only text parts are", f"{param}.{i}"
            )
    return "\n".join(p.text or "" for p in content)


def _items(items: list[InputItem]) -> list[Json]:
    """Input items as chat messages; consecutive function calls are one assistant message's calls."""
    msgs: list[Json] = []
    for i, it in enumerate(items):
        at = f"input.{i}"
        if it.type == "message":
            if it.role is None:
                raise bad_request("a message item needs a role", f"{at}.role")
            msgs.append({"role": it.role, "content": _text(it.content, f"{at}.content")})
        elif it.type == "function_call":
            if not (it.call_id and it.name):
                raise bad_request("a function_call item needs call_id and name", at)
            call = {
                "id": it.call_id,
                "type": "function",
                "function": {"name": it.name, "arguments": it.arguments or "{}"},
            }
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif it.type == "function_call_output":
            if not it.call_id:
                raise bad_request("a function_call_output item needs call_id", f"{at}.call_id")
            msgs.append(
                {"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output, f"{at}.output")}
            )
        elif it.type != "reasoning":
            raise bad_request(f"input items of type '{it.type}' are not supported", f"{at}.type")
    return msgs


def _response_format(text: TextConfig | None) -> Json | None:
    fmt = text.format.echo() if text is not None else {}
    if fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt["type"]}  # json_object


def _tools(body: ResponsesBody) -> tuple[list[Json] | None, Any]:
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in body.tools or []
    ]
    tc = body.tool_choice
    if tc is not None and not isinstance(tc, str):
        return tools or None, {"type": "function", "function": {"name": tc.name}}
    return tools or None, tc


@dataclass
class _Turn:
    """One request: its body, its conversation (as chat messages), and where it is stored."""

    store: ResponseStore
    owner: str
    created: int = field(default_factory=lambda: int(time.time()))
    body: ResponsesBody | None = None
    conversation: list[Json] = field(default_factory=list)
    rid: str = ""

    def to_chat(self, raw: Json) -> Json:
        body = self.body = parse_body(ResponsesBody, raw)
        history: list[Json] = []
        if body.previous_response_id is not None:
            prev = self.store.get(body.previous_response_id, self.owner)
            if prev is None:
                raise ApiError(
                    404,
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    "previous_response_id",
                )
            history = prev.messages()
        new = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else _items(body.input)
        self.conversation = [*history, *new]
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        tools, tool_choice = _tools(body)
        return {
            "model": body.model,
            "messages": [*system, *self.conversation],
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stream": body.stream,
            "stream_options": {"include_usage": True} if body.stream else None,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body.text),
            "reasoning_effort": body.reasoning.effort if body.reasoning else None,
            "user": body.user,
        }

    def echo(self, model: str) -> Json:
        b = self.body
        assert b is not None
        tc = b.tool_choice
        return {
            "model": model,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {
                "effort": b.reasoning.effort if b.reasoning else None,
                "summary": b.reasoning.summary if b.reasoning else None,
            },
            "store": b.store,
            "temperature": b.temperature,
            "text": (b.text or TextConfig()).echo(),
            "tool_choice": tc.echo() if isinstance(tc, NamedFunction) else tc or "auto",
            "tools": [t.echo() for t in b.tools or []],
            "top_p": b.top_p,
            "truncation": "disabled",
            "user": b.user,
        }

    def finish(self, chat_id: str, model: str, msg: Json, finish: str | None, usage: Json | None) -> Json:
        """The response object; stored with the conversation when `store`."""
        self.rid = f"resp_{chat_id}"
        out = response_object(
            self.echo(model), self.rid, self.created, output_items(self.rid, msg), finish, usage
        )
        assert self.body is not None
        if self.body.store:
            said = {"role": "assistant", "content": msg.get("content") or None}
            if msg.get("tool_calls"):
                said["tool_calls"] = msg["tool_calls"]
            self.store.put(self.rid, self.owner, out, [*self.conversation, said])
        return out

    def shape(self, chat: Json) -> Json:
        choice = chat["choices"][0]
        return self.finish(
            chat["id"], chat["model"], choice["message"], choice["finish_reason"], chat["usage"]
        )

    async def stream(
        self, events: AsyncGenerator[Json | ApiError, None], inputs: list[GenInput]
    ) -> AsyncGenerator[bytes, None]:
        s: ResponseStream | None = None
        chat_id, model, finish, usage = "", "", None, None
        async for ev in events:
            if isinstance(ev, ApiError):
                yield sse({**ev.body()["error"], "type": "error", "sequence_number": s.seq if s else 0})
                return
            if s is None:
                chat_id, model = ev["id"], ev["model"]
                s = ResponseStream(f"resp_{chat_id}")
                start = response_object(self.echo(model), s.rid, self.created, None, None, None)
                yield s.event("response.created", {"response": start})
                yield s.event("response.in_progress", {"response": start})
            if not ev["choices"]:
                usage = ev["usage"]
                continue
            for b in s.feed(ev["choices"][0]["delta"]):
                yield b
            finish = ev["choices"][0]["finish_reason"] or finish
        if s is None:
            return
        for b in s.close():
            yield b
        msg = {k: v for k, v in s.msg.items() if v}
        done = self.finish(chat_id, model, msg, finish, usage)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield s.event(kind, {"response": done})


def _owner(request: Request) -> str:
    gw = gateway_state(request)
    return owner_of(request.scope.get("headers", []), bool(gw.cfg.api_key))


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    turn = _Turn(gateway_state(request).responses, _owner(request))
    return await serve_chat_as(request, turn.to_chat, turn.shape, turn.stream)


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"No response found with id '{rid}'.", "response_id")


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    entry = gateway_state(request).responses.get(response_id, _owner(request))
    if entry is None:
        raise _not_found(response_id)
    return Response(entry.response_json, media_type="application/json")  # stored as it is answered


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Json:
    if not gateway_state(request).responses.delete(response_id, _owner(request)):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
