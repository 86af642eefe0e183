"""OpenAI Responses answers from the chat pipeline's: the `response` object from a chat completion's
message (`response_object`), and the typed event stream from its chunk objects (`ResponseStream`).

Output items come in the order the chat parsers release them: `reasoning` (the reasoning parser's
text), `message` (one `output_text` part), then one `function_call` per tool call. Item ids derive
from the response's and the call's, so a stream's items and the stored response agree. A choice cut
by max_output_tokens is `incomplete` (reason `max_output_tokens`), as OpenAI reports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.json_types import Json


def output_items(rid: str, msg: Json) -> list[Json]:
    """The output items of a chat message ({reasoning_content, content, tool_calls})."""
    items: list[Json] = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(rid, msg["reasoning_content"]))
    if msg.get("content"):
        items.append(message_item(rid, msg["content"]))
    items += [call_item(c, "completed") for c in msg.get("tool_calls") or []]
    return items


def reasoning_item(rid: str, text: str | None) -> Json:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": content}


def message_item(rid: str, text: str | None, status: str = "completed") -> Json:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: Json, status: str) -> Json:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{call['id']}",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if status == "completed" else "",
        "status": status,
    }


def response_usage(u: Json | None) -> Json | None:
    if not u:
        return None
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]},
        "total_tokens": u["total_tokens"],
    }


def response_object(
    echo: Json, rid: str, created: int, output: list[Json] | None, finish: str | None, usage: Json | None
) -> Json:
    """The response object; `echo` holds the request's parameters it repeats. `output` None: in progress."""
    status = "in_progress" if output is None else "incomplete" if finish == "length" else "completed"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        **echo,
        "output": output or [],
        "usage": response_usage(usage),
    }


@dataclass
class ResponseStream:
    """A stream's typed events out of chat chunk deltas; what it gave, as a chat message, at the end."""

    rid: str
    seq: int = 0
    index: int = -1  # the open output item's output_index
    open: str | None = None  # "reasoning" or "message"
    msg: Json = field(default_factory=lambda: {"reasoning_content": "", "content": "", "tool_calls": []})

    def event(self, kind: str, data: Json) -> bytes:
        body = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def _item(self, item: Json) -> Json:
        return {"output_index": self.index, "item": item}

    def _part(self) -> Json:
        return {"item_id": f"msg_{self.rid}", "output_index": self.index, "content_index": 0}

    def close(self) -> list[bytes]:
        """The events that end the open item."""
        if self.open == "reasoning":
            text = self.msg["reasoning_content"]
            done = {"item_id": f"rs_{self.rid}", "output_index": self.index, "content_index": 0, "text": text}
            out = [self.event("response.reasoning_text.done", done)]
            out.append(self.event("response.output_item.done", self._item(reasoning_item(self.rid, text))))
        elif self.open == "message":
            text = self.msg["content"]
            out = [self.event("response.output_text.done", {**self._part(), "text": text, "logprobs": []})]
            out.append(self.event("response.content_part.done", {**self._part(), "part": output_text(text)}))
            out.append(self.event("response.output_item.done", self._item(message_item(self.rid, text))))
        else:
            return []
        self.open = None
        return out

    def _start(self, kind: str, item: Json) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind if kind != "function_call" else None
        return [*out, self.event("response.output_item.added", self._item(item))]

    def feed(self, delta: Json) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open != "reasoning":
                out += self._start("reasoning", reasoning_item(self.rid, None))
            self.msg["reasoning_content"] += delta["reasoning_content"]
            at = {"item_id": f"rs_{self.rid}", "output_index": self.index, "content_index": 0}
            out.append(
                self.event("response.reasoning_text.delta", {**at, "delta": delta["reasoning_content"]})
            )
        if delta.get("content"):
            if self.open != "message":
                out += self._start("message", message_item(self.rid, None, "in_progress"))
                out.append(
                    self.event("response.content_part.added", {**self._part(), "part": output_text("")})
                )
            self.msg["content"] += delta["content"]
            out.append(
                self.event(
                    "response.output_text.delta", {**self._part(), "delta": delta["content"], "logprobs": []}
                )
            )
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        return out

    def _call(self, call: Json) -> list[bytes]:
        """A whole call (the chat parser releases calls whole): added, its arguments, done."""
        self.msg["tool_calls"].append(call)
        out = self._start("function_call", call_item(call, "in_progress"))
        at: Json = {"item_id": f"fc_{call['id']}", "output_index": self.index}
        args = call["function"]["arguments"]
        out.append(self.event("response.function_call_arguments.delta", {**at, "delta": args}))
        done = {**at, "name": call["function"]["name"], "arguments": args}
        out.append(self.event("response.function_call_arguments.done", done))
        out.append(self.event("response.output_item.done", self._item(call_item(call, "completed"))))
        return out


# Shapes the final response object: (chat message, finish_reason, chat usage) -> response.
Finisher = Callable[[Json, str | None, Json | None], Json]
