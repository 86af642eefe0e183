"""HTTP request bodies (pydantic) and their conversion to `SamplingParams`.

Lenient where SGLang and vLLM are, strict where a wrong guess would change the answer:
- a `null` value means the field's default, everywhere (each model drops null keys before validation);
- unknown keys are kept aside (pydantic's `extra="allow"`) and ignored, with one warning naming them
  (`parse_body`); a few known keys that would change the answer and cannot be honoured here
  (`REFUSED_IF_SET`: LoRA, images, hidden states, structural tags)
  are a 400 naming them when set to anything but their neutral value;
- types stay strict (no "1" -> 1 coercion).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.gateway.errors import ApiError, bad_request, validation_error_to_api
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

StopField = str | list[str] | None

# A request id is copied into every sample's answer and kept by the dashboard: bounded.
MAX_RID_CHARS = 256
# Seeds are int64 on the workers; a request's n samples use seed, seed + 1, ... (wrapping, see derive_seed).
SEED_RANGE = 1 << 63


def check_rid(rid: str | list[str] | None) -> str | list[str] | None:
    """A pydantic field validator: each rid at most `MAX_RID_CHARS` characters."""
    for r in [rid] if isinstance(rid, str) else rid or []:
        if len(r) > MAX_RID_CHARS:
            raise ValueError(f"a rid may have at most {MAX_RID_CHARS} characters, got {len(r)}")
    return rid


# Keys that cannot be ignored when set: pdserve cannot honour them and ignoring them would change the answer.
REFUSED_IF_SET: dict[str, str] = {
    "lora_path": "LoRA adapters are not supported",
    "image_data": "the model has no vision input",
    "video_data": "the model has no video input",
    "audio_data": "the model has no audio input",
    "input_embeds": "input embeddings are not supported",
    "return_hidden_states": "hidden states are not returned",
    "custom_logit_processor": "custom logit processors are not supported",
    "structural_tag": "structural tags are not supported (json_schema, regex and ebnf are)",
}


class LenientModel(BaseModel):
    """Unknown keys are kept in `model_extra` (checked and logged by `parse_body`); null is the default."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class _SamplingFields(LenientModel):
    """Sampling knobs shared by the native and the OpenAI bodies (None: the default)."""

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
    sampling_seed: int | None = None  # SGLang's name for the seed
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted: the tokenizer decides
    min_new_tokens: int | None = None
    # OpenAI's form: token id (as a string key) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    no_stop_trim: bool = False
    # Structured output (gateway/structured.py): at most one; SGLang's names.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


# ---- SGLang native /generate -----------------------------------------------------------------


class NativeSamplingParams(_SamplingFields):
    max_new_tokens: int | None = None
    n: int = Field(1, ge=1, le=128)


class GenerateBody(LenientModel):
    # Exactly one prompt field, also in the OpenAPI document (clients and schema-driven fuzzing read it).
    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}
    )

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # A list gives each prompt of a batch its own parameters.
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] = Field(
        default_factory=NativeSamplingParams
    )
    stream: bool = False
    rid: str | list[str] | None = None
    _rid = field_validator("rid")(check_rid)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    # Prompt logprobs from this position on (-1: none); bounded to stay an int32 on the workers.
    logprob_start_len: int = Field(-1, ge=-1, le=(1 << 31) - 1)
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        return self


# ---- OpenAI ----------------------------------------------------------------------------------


class StreamOptions(LenientModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(LenientModel):
    type: str
    text: str | None = None


class FunctionCall(LenientModel):
    name: str
    # A JSON string, as OpenAI sends it (some clients send the object itself).
    arguments: str | dict[str, Any] = "{}"


class ToolCall(LenientModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        for p in v if isinstance(v, list) else []:
            if p.type != "text":
                for kind, what in (("image", "vision"), ("video", "video"), ("audio", "audio")):
                    if kind in p.type:
                        raise ValueError(
                            f"a '{p.type}' content part is not supported: the model has no {what} input"
                        )
                raise ValueError(f"a '{p.type}' content part is not supported: only text parts are")
            if p.text is None:
                raise ValueError("a text content part needs 'text'")
        return v

    def text(self) -> str:
        """Multi-part text is joined with spaces, as SGLang does for string-content templates."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return " ".join(p.text or "" for p in self.content)


class FunctionDef(LenientModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(LenientModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(LenientModel):
    name: str


class NamedToolChoice(LenientModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _OpenAIBase(_SamplingFields):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    rid: str | None = None
    _rid = field_validator("rid")(check_rid)
    # Accepted and ignored: OpenAI's storage and tagging of completions.
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _stream_options(self) -> _OpenAIBase:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionBody(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # Passed to the chat template (e.g. {"enable_thinking": false}); reasoning_effort is passed there too.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # SGLang: with a reasoning parser, put the thinking text in reasoning_content (else leave it in content).
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, not in tools"
                )
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
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
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of other than n is not supported")
        return self


def _extras(model: BaseModel, prefix: str = "") -> list[tuple[str, Any]]:
    """Every unknown key of `model` and the models inside it: (dotted path, value)."""
    out = [(f"{prefix}{k}", v) for k, v in (model.model_extra or {}).items()]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                sub = f"{prefix}{name}." + (f"{i}." if isinstance(value, list) else "")
                out += _extras(item, sub)
    return out


def parse_body(model: type[BaseModel], body: dict) -> Any:
    """Validate; refuse set keys of `REFUSED_IF_SET`; log the ignored unknown keys in one line."""
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api(e) from None
    ignored = []
    for path, value in _extras(parsed):
        reason = REFUSED_IF_SET.get(path.rsplit(".", 1)[-1])
        if reason is None:
            ignored.append(path)
        elif value not in (False, "", [], {}):
            raise ApiError(400, f"{path}: {reason}", path, code="unsupported_parameter")
    if ignored:
        log.warning("ignoring unknown request fields: %s", ", ".join(ignored))
    return parsed


def stop_list(stop: StopField) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(raw: dict[str, float] | None, vocab_size: int | None, param: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in (raw or {}).items():
        try:
            tid = int(k)
        except ValueError:
            raise bad_request(f"{param}: key {k!r} is not a token id", param) from None
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            raise bad_request(f"{param}: token id {tid} is outside the vocabulary", param)
        if not -100.0 <= v <= 100.0:
            raise bad_request(f"{param}: a bias must be between -100 and 100, got {v}", param)
        out[tid] = v
    return out


def _check_vocab_ids(values: dict[str, Any], vocab_size: int | None, prefix: str) -> None:
    """Token-id parameters within the vocabulary: stop_token_ids refused outside it (400), a top_k of
    the vocabulary or more is no top-k at all (-1: what it means, in a range the workers take)."""
    if vocab_size is None:
        return
    top_k = values.get("top_k")
    if top_k is not None and top_k >= vocab_size:
        values["top_k"] = -1
    for tid in values.get("stop_token_ids") or []:
        if not 0 <= tid < vocab_size:
            param = f"{prefix}.stop_token_ids" if prefix else "stop_token_ids"
            raise bad_request(
                f"{param}: token id {tid} is outside the vocabulary (0..{vocab_size - 1})", param
            )


def build_sampling(
    fields: _SamplingFields,
    max_new_tokens: int | None,
    logprobs: bool,
    top_logprobs_num: int,
    param_prefix: str = "",
    vocab_size: int | None = None,
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
            "min_new_tokens",
            "json_schema",
            "regex",
            "ebnf",
        )
        if getattr(fields, k) is not None
    }
    if fields.seed is None and fields.sampling_seed is not None:
        values["seed"] = fields.sampling_seed
    _check_vocab_ids(values, vocab_size, param_prefix)
    values["stop"] = stop_list(fields.stop)
    values["ignore_eos"] = fields.ignore_eos
    values["no_stop_trim"] = fields.no_stop_trim
    values["logprobs"] = logprobs
    values["top_logprobs_num"] = top_logprobs_num
    bias_param = f"{param_prefix}.logit_bias" if param_prefix else "logit_bias"
    values["logit_bias"] = _logit_bias(fields.logit_bias, vocab_size, bias_param)
    if max_new_tokens is not None:
        values["max_new_tokens"] = max_new_tokens
    limit = values.get("max_new_tokens", SamplingParams.model_fields["max_new_tokens"].default)
    # (A negative max_new_tokens is SamplingParams' own 400 below.)
    if "min_new_tokens" in values and limit >= 0 and values["min_new_tokens"] > limit:
        param = f"{param_prefix}.min_new_tokens" if param_prefix else "min_new_tokens"
        raise bad_request(f"{param}: {values['min_new_tokens']} is more than max_new_tokens ({limit})", param)
    try:
        return SamplingParams(**values)
    except ValidationError as e:
        raise validation_error_to_api(e, param_prefix) from None


def with_max_new_tokens(sp: SamplingParams, n: int) -> SamplingParams:
    return sp.model_copy(update={"max_new_tokens": n, "min_new_tokens": min(sp.min_new_tokens, n)})


def with_seed(sp: SamplingParams, seed: int | None) -> SamplingParams:
    return sp.model_copy(update={"seed": seed})


def derive_seed(seed: int | None, j: int) -> int | None:
    """Sample `j`'s seed of a request seeded `seed` (n > 1: distinct but reproducible samples), kept
    within int64 by wrapping past 2**63 - 1 to 0."""
    return None if seed is None else (seed + j) % SEED_RANGE


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
    "REFUSED_IF_SET",
    "ApiError",
    "ChatCompletionBody",
    "ChatMessage",
    "CompletionBody",
    "GenerateBody",
    "NativeSamplingParams",
    "Tool",
    "ToolCall",
    "build_sampling",
    "check_prompt_ids",
    "check_rid",
    "derive_seed",
    "parse_body",
    "stop_list",
    "with_max_new_tokens",
    "with_seed",
]
