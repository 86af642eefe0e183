"""The tokenizer over HTTP: /tokenize, /detokenize (vLLM's and SGLang's shapes) and /tokenizer_info
(vLLM's), what lm-evaluation-harness's remote tokenizer asks (`tokenizer_backend=remote`).

- POST /tokenize: `{"prompt" | "text": str, "add_special_tokens": true}`, or vLLM's chat form
  `{"messages": [...], "add_generation_prompt": true, "tools", "chat_template_kwargs"}` (rendered as
  /v1/chat/completions renders them: function_call/prompt.py, then the chat template) ->
  `{"count", "max_model_len", "tokens"}` (and `"token_strs"` with `return_token_strs`);
- POST /detokenize: `{"tokens": [ids]}` -> `{"prompt": text}` (vLLM), also as `"text"` (SGLang);
- GET /tokenizer_info: the tokenizer's configuration (its special tokens, chat template, length).
`model`, when given, must be the served name.

Held to /generate's limits (gateway/api/serving.py `serve_body_work`): each request takes one of its
client's `--max-requests-per-client` slots (429 beyond) and its body is bounded as a generation's. A
text, or the messages as rendered, longer than the context length times the tokenizer's longest token
(`Tokenizer.check_chars`, /generate's bound: 663,552 characters for the bundled model at 8,192 tokens)
is a 400 naming the field, before it is tokenized; /tokenize returns, and /detokenize takes, at most as
many tokens (`max_tokens`: a tokenization past it is a 400 too). With no worker in rotation the context
length is taken as `UNKNOWN_CONTEXT`. A body over 4 KiB is decoded, tokenized (or decoded), and its
answer built, token strings and JSON included, in a thread of the parse pool, one at a time, and sent
as the bytes built there: a flood of the largest requests leaves the event loop its heartbeats.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, model_validator

from pdserve.gateway.api.openai_api import chat_prompt_ids
from pdserve.gateway.api.request_body import gc_paused
from pdserve.gateway.api.serving import json_bytes, serve_body_work
from pdserve.gateway.api.state import GatewayState, gateway_state
from pdserve.gateway.errors import bad_request, model_not_found, parse_json_body
from pdserve.gateway.protocol import parse_body
from pdserve.gateway.request_models import ChatCompletionBody, ChatMessage, LenientModel, Tool

router = APIRouter()
Json = dict[str, Any]
Body = TypeVar("Body", bound=LenientModel)
# The context length assumed while no worker is in rotation (none to tell it): the bundled model's.
UNKNOWN_CONTEXT = 8192


class TokenizeBody(LenientModel):
    model: str | None = None
    prompt: str | None = None
    text: str | None = None  # SGLang's name
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        given = [k for k in ("prompt", "text", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'prompt' (or 'text') and 'messages'")
        return self


class DetokenizeBody(LenientModel):
    model: str | None = None
    tokens: list[int]


def _decode(model: type[Body], raw: bytes) -> Body:
    with gc_paused():  # as for generation bodies (request_body.py)
        return parse_body(model, parse_json_body(raw))


def _check_model(gw: GatewayState, model: str | None) -> None:
    if model is not None and model != gw.model_name:
        raise model_not_found(model)


def _max_len(gw: GatewayState) -> int | None:
    limits = gw.registry.limits()
    return limits.context_length if limits else None


def _context(gw: GatewayState) -> int:
    return _max_len(gw) or UNKNOWN_CONTEXT


def max_tokens(gw: GatewayState) -> int:
    """The most tokens /tokenize returns and /detokenize takes: as many as the characters a prompt may
    have (the context length x the longest token's characters)."""
    return _context(gw) * gw.tokenizer.max_token_chars


def _tokenize(gw: GatewayState, body: TokenizeBody) -> tuple[list[int], str]:
    """The prompt's ids, and the field they came from."""
    tok, ctx = gw.tokenizer, _context(gw)
    if body.messages is not None:
        chat = ChatCompletionBody(
            messages=body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs
        )
        ids = chat_prompt_ids(tok, gw.cfg.tool_call_parser, chat, ctx, body.add_generation_prompt)
        return ids, "messages"
    text, param = (body.prompt, "prompt") if body.prompt is not None else (body.text, "text")
    assert text is not None
    tok.check_chars(text, ctx, param)
    return list(tok.hf.encode(text, add_special_tokens=body.add_special_tokens)), param


def _token_strs(gw: GatewayState, ids: list[int]) -> list[str]:
    # Each distinct id decoded once (at most the vocabulary), not each token (2.5 us each: 1.7 s for
    # 663,552 tokens).
    text = {t: gw.tokenizer.token_text(t) for t in set(ids)}
    return [text[t] for t in ids]


def _tokenize_answer(gw: GatewayState, raw: bytes) -> bytes:
    body = _decode(TokenizeBody, raw)
    _check_model(gw, body.model)
    ids, param = _tokenize(gw, body)
    limit = max_tokens(gw)
    if len(ids) > limit:
        raise bad_request(f"the prompt has {len(ids)} tokens; /tokenize returns at most {limit}", param)
    out: Json = {"count": len(ids), "max_model_len": _max_len(gw), "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = _token_strs(gw, ids)
    return json_bytes(out)


def _detokenize_answer(gw: GatewayState, raw: bytes) -> bytes:
    body = _decode(DetokenizeBody, raw)
    _check_model(gw, body.model)
    vocab, limit = gw.tokenizer.vocab_size, max_tokens(gw)
    if len(body.tokens) > limit:
        raise bad_request(f"tokens has {len(body.tokens)} ids; /detokenize takes at most {limit}", "tokens")
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
    text = gw.tokenizer.decode(body.tokens, False)
    return json_bytes({"prompt": text, "text": text})


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    gw = gateway_state(request)
    return await serve_body_work(request, gw.admission, gw.cfg, lambda raw: _tokenize_answer(gw, raw))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    gw = gateway_state(request)
    return await serve_body_work(request, gw.admission, gw.cfg, lambda raw: _detokenize_answer(gw, raw))


def _plain(value: Any) -> Any:
    """A tokenizer config value as JSON: special tokens (AddedToken) as their text."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(getattr(value, "content", value))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Json:
    """vLLM's answer: the tokenizer's init config (special tokens as text), its class and chat template."""
    gw = gateway_state(request)
    hf = gw.tokenizer.hf
    init = getattr(hf, "init_kwargs", {}) or {}
    info: Json = {k: _plain(v) for k, v in init.items() if k not in ("added_tokens_decoder", "name_or_path")}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = _plain(getattr(hf, name, None))
    info["tokenizer_class"] = type(hf).__name__
    info["chat_template"] = hf.chat_template if isinstance(hf.chat_template, str) else None
    info["model_max_length"] = _max_len(gw) or _plain(init.get("model_max_length"))
    info["vocab_size"] = gw.tokenizer.vocab_size
    return info
