"""The body of POST /v1/responses (pydantic), and the request fields its response object repeats.

The response object echoes `text`, `tools`, `tool_choice`, `reasoning` and `metadata`, and the store
keeps it for an hour: each of them is held to OpenAI's shape, and an unknown key inside one is a 400
(as OpenAI answers it) rather than something kept. Only what the shape names is echoed. `metadata`
has OpenAI's caps (request_models.Metadata). Unknown top-level keys are ignored, as everywhere
(protocol.parse_body), and nothing of them is kept.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from pdserve.gateway.request_models import LenientModel, Metadata
from pdserve.json_types import Json


class Part(LenientModel):
    type: str
    text: str | None = None


class InputItem(LenientModel):
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class _Echoed(LenientModel):
    """A part of the request the response repeats: no key beyond those named."""

    model_config = ConfigDict(extra="forbid")

    def echo(self) -> Json:
        return self.model_dump(exclude_none=True, by_alias=True)


class FunctionTool(_Echoed):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        # Named before its other keys are checked: a web_search tool has keys a function has not.
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tools of type '{kind}' are not supported (function only)")
        return data


class NamedFunction(_Echoed):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)


class TextFormat(_Echoed):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Echoed):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Echoed):
    effort: str | None = Field(None, max_length=32)
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's former name


class ResponsesBody(LenientModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    user: str | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _named_function(cls, v: Any) -> Any:
        # One message for every other shape (the union's own would list each member's complaint).
        if isinstance(v, dict) and not (
            v.get("type") == "function" and isinstance(v.get("name"), str) and set(v) <= {"type", "name"}
        ):
            raise ValueError("must be auto, none, required or {type: function, name}")
        return v
