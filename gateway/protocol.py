"""From a request's JSON to what its generations run: `parse_body` validates a body (request_models.py)
and refuses or ignores its unknown keys; `build_sampling` turns its knobs into `SamplingParams`.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pdserve.gateway.errors import ApiError, bad_request, validation_error_to_api
from pdserve.gateway.request_models import SamplingFields, StopField
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Seeds are int64 on the workers; a request's n samples use seed, seed + 1, ... (wrapping, see derive_seed).
SEED_RANGE = 1 << 63

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


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], body: dict[str, Any]) -> Body:
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
    fields: SamplingFields,
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
