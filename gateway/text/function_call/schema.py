"""The JSON schema a reply must follow under `tool_choice: "required"` or a named function.

Without a grammar backend, pdserve accepts such requests and relies on the prompt (which tells the model
it must call) plus parsing; the enforcement arrives with the grammar backend, which constrains the
reply to this schema. A constrained reply is plain JSON (no format markers), read back by
`calls_from_constrained`:
- `"required"`: an array (at least one item; at most one with `parallel_tool_calls: false`) of
  `{"name": <one of the tools>, "parameters": <its schema>}`;
- a named function: that function's parameters object alone.
A reply cut short (max_tokens) inside the array keeps the calls it completed.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.request_models import NamedToolChoice, Tool
from pdserve.gateway.text.function_call.base import ParsedCall, call_from_json, decode_json

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_call_schema(
    tools: list[Tool], tool_choice: str | NamedToolChoice, parallel: bool = True
) -> dict[str, Any]:
    """The schema of a reply that calls a tool, for a grammar backend to enforce."""
    if isinstance(tool_choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == tool_choice.function.name)
        return fn.parameters or _ANY_OBJECT
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the reply")
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _complete_items(text: str) -> list[Any]:
    """The whole items at the start of a JSON array that may be cut short: `[{...}, {..` -> [{...}]."""
    pos = text.find("[")
    if pos < 0 or text[:pos].strip():
        return []
    items: list[Any] = []
    pos += 1
    while True:
        got = decode_json(text, pos)
        if got is None:
            return items
        items.append(got[0])
        pos = got[1]
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text) or text[pos] != ",":
            return items
        pos += 1


def calls_from_constrained(
    text: str, tool_choice: str | NamedToolChoice, parallel: bool = True
) -> list[ParsedCall]:
    """The calls of a reply that follows `tool_call_schema`, the complete ones of a reply cut short;
    [] if it holds none. Without `parallel`, the first call only."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None if isinstance(tool_choice, NamedToolChoice) else _complete_items(text)
    if isinstance(tool_choice, NamedToolChoice):
        if not isinstance(value, dict):
            return []
        return [ParsedCall(tool_choice.function.name, json.dumps(value, ensure_ascii=False))]
    items = value if isinstance(value, list) else []
    calls = [c for c in (call_from_json(v) for v in items) if c is not None]
    return calls if parallel else calls[:1]
