"""Per-request sampling parameters, validated once at the edge and shared by every role.

The gateway builds a `SamplingParams` from the HTTP body (a pydantic validation error becomes an
HTTP 400); workers receive it inside wire messages and hand it to the runtime's sampler. Stop
*strings* are matched by the gateway on detokenized text; everything else is enforced on the
decode node.

A request may carry one output constraint: `json_schema` (the schema's JSON text), `regex` or
`ebnf` (SGLang's native fields; the gateway maps OpenAI's `response_format` onto `json_schema`).
The nodes that sample mask the logits to it (pdserve/runtime/grammar/).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Stop strings: how many, and how long each (the gateway matches them against every output character).
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
# Temperatures below this are greedy, as in SGLang and vLLM (their _SAMPLING_EPS): dividing the logits
# by 1e-38 overflows them to inf, and what comes out is no longer the most likely token.
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(128, ge=0, le=1 << 20)
    # 0 means greedy (argmax), as in SGLang.
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # -1 (or 0) disables top-k; the gateway turns a top_k of the vocabulary or more into -1.
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    # Number of top alternatives returned with each sampled token's logprob (0: only the token's).
    logprobs: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    # Prompt logprobs (SGLang's logprob_start_len): from this prompt position on, the prefill node
    # returns each prompt token's logprob (and top_logprobs_num alternatives); -1: none.
    logprob_start_len: int = Field(-1, ge=-1)
    # EOS and stop_token_ids are masked out of the distribution until this many tokens exist (SGLang).
    min_new_tokens: int = Field(0, ge=0, le=1 << 20)
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, -100..100).
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=1024)
    # Keep a matched stop string (or stop token's text) in the output text (SGLang's no_stop_trim).
    no_stop_trim: bool = False
    # Structured output: at most one of these (see `constraint`).
    json_schema: str | None = Field(None, max_length=1 << 20)
    regex: str | None = Field(None, max_length=1 << 16)
    ebnf: str | None = Field(None, max_length=1 << 20)

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, t: float) -> float:
        return 0.0 if t < GREEDY_BELOW_TEMPERATURE else t

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        # The gateway checks token ids against the vocabulary (gateway/protocol.py).
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        if sum(c is not None for c in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("give at most one of json_schema, regex and ebnf")
        return self

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, kind one of json_schema / regex / ebnf; or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
