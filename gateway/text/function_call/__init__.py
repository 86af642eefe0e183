"""Tool calling: formats (one module each), streaming parser, prompt rendering, constraint schema.

`--tool-call-parser` names a format with SGLang's names (`qwen25`, `qwen`, `llama3`, `mistral`; `hermes`
as vLLM calls the first); without one, requests with tools use hermes.
"""

from __future__ import annotations

from pdserve.gateway.text.function_call.base import ParsedCall, ToolCallFormat
from pdserve.gateway.text.function_call.hermes import HermesFormat
from pdserve.gateway.text.function_call.llama3 import Llama3Format
from pdserve.gateway.text.function_call.mistral import MistralFormat

_FORMATS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesFormat,
    "qwen25": HermesFormat,
    "qwen": HermesFormat,
    "llama3": Llama3Format,
    "mistral": MistralFormat,
}
PARSER_NAMES = sorted(_FORMATS)
DEFAULT_PARSER = "hermes"


def tool_call_format(name: str | None) -> ToolCallFormat:
    return _FORMATS[name or DEFAULT_PARSER]()


__all__ = ["DEFAULT_PARSER", "PARSER_NAMES", "ParsedCall", "ToolCallFormat", "tool_call_format"]
