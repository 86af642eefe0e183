"""The JSON schema a reply must follow under `tool_choice: "required"` or a named function.

Without a grammar backend, pdserve accepts such requests and relies on the prompt (which tells the model
it must call) plus parsing; the enforcement arrives with the grammar backend, which constrains the
reply to this schema. A constrained reply is plain JSON (no format markers), read back by
`calls_from_constrained`:
- `"required"`: an array (at least one item) of `{"name": <one of the tools>, "parameters": <its schema>}`;
- a named function: that function's parameters object alone.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.function_call.base import ParsedCall, call_from_json
from pdserve.gateway.request_models import NamedToolChoice, Tool

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_call_schema(tools: list[Tool], tool_choice: str | NamedToolChoice) -> dict[str, Any]:
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
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}


def calls_from_constrained(text: str, tool_choice: str | NamedToolChoice) -> list[ParsedCall]:
    """The calls of a reply that follows `tool_call_schema`; [] if it does not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(tool_choice, NamedToolChoice):
        if not isinstance(value, dict):
            return []
        return [ParsedCall(tool_choice.function.name, json.dumps(value, ensure_ascii=False))]
    items = value if isinstance(value, list) else []
    calls = [call_from_json(v) for v in items]
    return [c for c in calls if c is not None]
