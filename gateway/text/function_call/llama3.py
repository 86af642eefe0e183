"""Llama 3.1 / 3.2 JSON format (SGLang's `llama3`):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

or the same JSON object alone as the whole reply; several calls are separated by `;`.
`<|python_tag|>` is a special token: requests with tools decode it (see openai_api).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.text.function_call.base import ToolCallFormat, decode_json, partial_suffix

_TAG = "<|python_tag|>"


class Llama3Format(ToolCallFormat):
    start = _TAG

    def find_start(self, text: str) -> int:
        if text.lstrip().startswith("{"):  # a bare JSON reply is a call
            return 0
        return text.find(_TAG)

    def holdback(self, text: str) -> int:
        if not text.strip():
            return len(text)  # the reply may still begin with "{"
        return partial_suffix(text, _TAG)

    def calls(self, section: str, final: bool) -> list[Any]:
        pos = len(_TAG) if section.startswith(_TAG) else 0  # else it starts with whitespace and "{"
        out: list[Any] = []
        while True:
            while pos < len(section) and (section[pos].isspace() or section[pos] == ";"):
                pos += 1
            if pos >= len(section) or section[pos] != "{":
                return out
            got = decode_json(section, pos)
            if got is None:
                return out
            obj, pos = got
            out.append(obj)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(self.render_call(n, a) for n, a in calls)
