"""Mistral format (SGLang's `mistral`):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

one JSON array holding every call. `[TOOL_CALLS]` is a control token in Mistral's tokenizers.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.text.function_call.base import ToolCallFormat, decode_json

_TAG = "[TOOL_CALLS]"


class MistralFormat(ToolCallFormat):
    start = _TAG

    def calls(self, section: str, final: bool) -> list[Any]:
        got = decode_json(section, len(_TAG))
        if got is None:
            return []
        value = got[0]
        return value if isinstance(value, list) else [value]

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        body = [{"name": n, "arguments": a} for n, a in calls]
        return f"{_TAG} {json.dumps(body, ensure_ascii=False)}"
