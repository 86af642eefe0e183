"""HTTP request bodies (pydantic) and their conversion to `SamplingParams`.

Models are strict (no "1" -> 1 coercion) and refuse unknown fields, as OpenAI does; a few OpenAI
fields the gateway does not implement are accepted only with their neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdserve.gateway.errors import ApiError, bad_request, validation_error_to_api
from pdserve.sampling_params import SamplingParams

_STRICT = ConfigDict(extra="forbid", strict=True)

StopField = str | list[str] | None


class _SamplingFields(BaseModel):
    """Sampling knobs shared by the native and the OpenAI bodies (None: the default)."""

    model_config = _STRICT

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # Structured output (gateway/structured.py): at most one; SGLang's names.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


# ---- SGLang native /generate -----------------------------------------------------------------


class NativeSamplingParams(_SamplingFields):
    max_new_tokens: int | None = None
    n: int = Field(1, ge=1, le=128)


class GenerateBody(BaseModel):
    model_config = _STRICT

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    # Accepted for compatibility: logprobs are returned for output tokens only.
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        return self


# ---- OpenAI ----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _OpenAIBase(_SamplingFields):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only when neutral (None / empty): the gateway has no logit bias.
    logit_bias: dict[str, float] | None = None
    rid: str | None = None

    @model_validator(mode="after")
    def _neutral(self) -> _OpenAIBase:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionBody(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported")
        return self


class CompletionBody(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for the legacy completions endpoint.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionBody:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of other than n is not supported")
        return self


def parse_body(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api(e) from None


def stop_list(stop: StopField) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def build_sampling(
    fields: _SamplingFields,
    max_new_tokens: int | None,
    logprobs: bool,
    top_logprobs_num: int,
    param_prefix: str = "",
) -> SamplingParams:
    """Merge the request's knobs over SamplingParams' defaults; range errors become HTTP 400."""
    values: dict[str, Any] = {
        k: getattr(fields, k)
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "stop_token_ids",
            "seed",
            "json_schema",
            "regex",
            "ebnf",
        )
        if getattr(fields, k) is not None
    }
    values["stop"] = stop_list(fields.stop)
    values["ignore_eos"] = fields.ignore_eos
    values["logprobs"] = logprobs
    values["top_logprobs_num"] = top_logprobs_num
    if max_new_tokens is not None:
        values["max_new_tokens"] = max_new_tokens
    try:
        return SamplingParams(**values)
    except ValidationError as e:
        raise validation_error_to_api(e, param_prefix) from None


def with_max_new_tokens(sp: SamplingParams, n: int) -> SamplingParams:
    return sp.model_copy(update={"max_new_tokens": n})


def with_seed(sp: SamplingParams, seed: int | None) -> SamplingParams:
    return sp.model_copy(update={"seed": seed})


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty", param)
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
            param,
        )


__all__ = [
    "ApiError",
    "ChatCompletionBody",
    "ChatMessage",
    "CompletionBody",
    "GenerateBody",
    "NativeSamplingParams",
    "build_sampling",
    "check_prompt_ids",
    "parse_body",
    "stop_list",
    "with_max_new_tokens",
    "with_seed",
]
