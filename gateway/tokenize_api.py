"""The tokenizer over HTTP: /tokenize, /detokenize (vLLM's and SGLang's shapes) and /tokenizer_info
(vLLM's), what lm-evaluation-harness's remote tokenizer asks (`tokenizer_backend=remote`).

- POST /tokenize: `{"prompt" | "text": str, "add_special_tokens": true}`, or vLLM's chat form
  `{"messages": [...], "add_generation_prompt": true, "tools", "chat_template_kwargs"}` (rendered as
  /v1/chat/completions renders them: function_call/prompt.py, then the chat template) ->
  `{"count", "max_model_len", "tokens"}` (and `"token_strs"` with `return_token_strs`);
- POST /detokenize: `{"tokens": [ids]}` -> `{"prompt": text}` (vLLM), also as `"text"` (SGLang);
- GET /tokenizer_info: the tokenizer's configuration (its special tokens, chat template, length).
`model`, when given, must be the served name. Tokenizing runs off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, model_validator

from pdserve.gateway.errors import bad_request, model_not_found, parse_json_body
from pdserve.gateway.openai_api import chat_prompt_ids
from pdserve.gateway.protocol import parse_body
from pdserve.gateway.request_body import read_body
from pdserve.gateway.request_models import ChatCompletionBody, ChatMessage, LenientModel, Tool
from pdserve.gateway.state import GatewayState, gateway_state

router = APIRouter()
Json = dict[str, Any]


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


async def _body(request: Request, gw: GatewayState) -> Json:
    raw = await read_body(request, gw.cfg.max_request_bytes, gw.cfg.request_body_timeout_s, gw.admission)
    try:
        return parse_json_body(raw)
    finally:
        gw.admission.give_body(len(raw))


def _check_model(gw: GatewayState, model: str | None) -> None:
    if model is not None and model != gw.model_name:
        raise model_not_found(model)


def _max_len(gw: GatewayState) -> int | None:
    limits = gw.registry.limits()
    return limits.context_length if limits else None


def _tokenize(gw: GatewayState, body: TokenizeBody) -> list[int]:
    tok = gw.tokenizer
    if body.messages is not None:
        chat = ChatCompletionBody(
            messages=body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs
        )
        return chat_prompt_ids(tok, gw.cfg.tool_call_parser, chat, None, body.add_generation_prompt)
    text = body.prompt if body.prompt is not None else body.text
    assert text is not None
    return list(tok.hf.encode(text, add_special_tokens=body.add_special_tokens))


@router.post("/tokenize")
async def tokenize(request: Request) -> Json:
    gw = gateway_state(request)
    body = parse_body(TokenizeBody, await _body(request, gw))
    _check_model(gw, body.model)
    ids = await asyncio.to_thread(_tokenize, gw, body)
    out: Json = {"count": len(ids), "max_model_len": _max_len(gw), "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [gw.tokenizer.token_text(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(request: Request) -> Json:
    gw = gateway_state(request)
    body = parse_body(DetokenizeBody, await _body(request, gw))
    _check_model(gw, body.model)
    bad = [t for t in body.tokens if not 0 <= t < gw.tokenizer.vocab_size]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is outside the vocabulary (0..{gw.tokenizer.vocab_size - 1})", "tokens"
        )
    text = await asyncio.to_thread(gw.tokenizer.decode, body.tokens, False)
    return {"prompt": text, "text": text}


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
