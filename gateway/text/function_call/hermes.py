"""Hermes / Qwen 2.5 format (SGLang's `qwen25`, `qwen`; vLLM's `hermes`):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several blocks for parallel calls.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.text.function_call.base import ToolCallFormat, decode_json

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class HermesFormat(ToolCallFormat):
    start = _OPEN

    def calls(self, section: str, final: bool) -> list[Any]:
        out: list[Any] = []
        pos = 0
        while True:
            pos = section.find(_OPEN, pos)
            if pos < 0:
                return out
            got = decode_json(section, pos + len(_OPEN))
            if got is None:
                return out
            obj, end = got
            rest = section[end:].lstrip()
            # Closed, or (at the end of the output) left open before the next call or the end.
            if not (rest.startswith(_CLOSE) or (final and (not rest or rest.startswith(_OPEN)))):
                return out
            out.append(obj)
            pos = end

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{_OPEN}\n{body}\n{_CLOSE}"
