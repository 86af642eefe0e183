"""HTTP request bodies (pydantic): the native /generate body, the OpenAI bodies, and their shared parts.

Lenient where SGLang and vLLM are, strict where a wrong guess would change the answer:
- a `null` value means the field's default, everywhere (each model drops null keys before validation);
- unknown keys are kept aside (pydantic's `extra="allow"`) and ignored, with one warning naming them
  (`protocol.parse_body`); a few known keys that would change the answer and cannot be honoured here
  (`protocol.REFUSED_IF_SET`: LoRA, images, hidden states, structural tags)
  are a 400 naming them when set to anything but their neutral value;
- types stay strict (no "1" -> 1 coercion).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

StopField = str | list[str] | None

# A request id is copied into every sample's answer and kept by the dashboard: bounded.
MAX_RID_CHARS = 256


def check_rid(rid: str | list[str] | None) -> str | list[str] | None:
    """A pydantic field validator: each rid at most `MAX_RID_CHARS` characters."""
    for r in [rid] if isinstance(rid, str) else rid or []:
        if len(r) > MAX_RID_CHARS:
            raise ValueError(f"a rid may have at most {MAX_RID_CHARS} characters, got {len(r)}")
    return rid


# OpenAI's caps on `metadata` (chat completions, responses): kept with the request or the stored response.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def check_metadata(value: Any) -> Any:
    """At most `MAX_METADATA_KEYS` keys of at most `MAX_METADATA_KEY_CHARS` characters, string values
    of at most `MAX_METADATA_VALUE_CHARS`. Runs before the type check, so 250k keys cost one len()."""
    if not isinstance(value, dict):
        return value  # the type check names it
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"too many keys: expected at most {MAX_METADATA_KEYS}, got {len(value)}")
    for k, v in value.items():
        if isinstance(k, str) and len(k) > MAX_METADATA_KEY_CHARS:
            raise ValueError(
                f"key {k[:20]!r}... too long: at most {MAX_METADATA_KEY_CHARS} characters, got {len(k)}"
            )
        if isinstance(v, str) and len(v) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(
                f"value of {k[:20]!r} too long: at most {MAX_METADATA_VALUE_CHARS} characters, got {len(v)}"
            )
    return value


Metadata = Annotated[dict[str, str], BeforeValidator(check_metadata)]


class LenientModel(BaseModel):
    """Unknown keys are kept in `model_extra` (checked and logged by `protocol.parse_body`); null is the
    default."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class SamplingFields(LenientModel):
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
    # Structured output (gateway/text/structured.py): at most one; SGLang's names.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


# ---- SGLang native /generate -----------------------------------------------------------------


class NativeSamplingParams(SamplingFields):
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


class _OpenAIBase(SamplingFields):
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
    metadata: Metadata | None = None

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
