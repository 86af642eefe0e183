"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models (SGLang's shapes)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.gateway.errors import ApiError, bad_request
from pdserve.gateway.generation import GenInput, GenState
from pdserve.gateway.protocol import (
    ChatCompletionBody,
    CompletionBody,
    build_sampling,
    parse_body,
    with_seed,
)
from pdserve.gateway.serving import SSE_DONE, merge_streams, serve_generation, sse
from pdserve.gateway.tokenizer import Tokenizer
from pdserve.sampling_params import SamplingParams

router = APIRouter()


@dataclass(frozen=True)
class _Reply:
    """What every response of one request shares."""

    id: str
    created: int
    model: str
    chat: bool
    n: int
    logprobs: bool
    include_usage: bool


@router.get("/v1/models")
async def models(request: Request) -> dict:
    gw = request.app.state.gw
    return {
        "object": "list",
        "data": [
            {
                "id": gw.cfg.served_model_name,
                "object": "model",
                "created": gw.started,
                "owned_by": "pdserve",
                "root": gw.cfg.served_model_name,
                "max_model_len": gw.registry.limits().context_length if gw.registry.limits() else None,
            }
        ],
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


async def _serve(request: Request, chat: bool) -> Response:
    gw = request.app.state.gw
    reply: _Reply | None = None

    def parse(raw: dict, received: float) -> tuple[list[GenInput], bool, str]:
        nonlocal reply
        body = parse_body(ChatCompletionBody if chat else CompletionBody, raw)
        if chat:
            prompts, param = [_chat_prompt(gw.tokenizer, body)], "messages"
            max_new = (
                body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            )
            logprobs, top_n = body.logprobs, body.top_logprobs or 0
        else:
            prompts, param = _completion_prompts(gw.tokenizer, body.prompt), "prompt"
            max_new, logprobs, top_n = body.max_tokens, body.logprobs is not None, body.logprobs or 0
        sampling = build_sampling(body, max_new, logprobs, top_n)
        sampling = gw.constraints.apply(sampling, body.response_format)  # structured output
        rid = body.rid or uuid.uuid4().hex
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        reply = _Reply(rid, int(received), gw.cfg.served_model_name, chat, body.n, logprobs, include_usage)
        inputs = [
            _gen_input(
                f"{rid}-{i * body.n + j}",
                p,
                sampling,
                j,
                max_new is not None,
                received,
                body.skip_special_tokens,
            )
            for i, p in enumerate(prompts)
            for j in range(body.n)
        ]
        return inputs, body.stream, param

    def full(states: list[GenState]) -> dict:
        assert reply is not None
        return _full_response(gw.tokenizer, reply, states)

    def chunks(inputs: list[GenInput]) -> AsyncIterator[bytes]:
        assert reply is not None
        return _stream(gw, reply, inputs)

    return await serve_generation(request, gw.admission, gw.generations, parse, full, chunks)


def _gen_input(
    rid: str, ids: list[int], sp: SamplingParams, j: int, given: bool, received: float, skip: bool
) -> GenInput:
    # n > 1 with a seed: distinct but reproducible samples.
    seed = None if sp.seed is None else sp.seed + j
    return GenInput(rid, list(ids), with_seed(sp, seed), given, received, skip)


def _chat_prompt(tok: Tokenizer, body: ChatCompletionBody) -> list[int]:
    msgs = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    try:
        return tok.encode_chat(msgs)
    except Exception as e:  # jinja errors from the model's template (e.g. role order)
        raise bad_request(f"the chat template refused the messages: {e}", "messages") from None


def _completion_prompts(tok: Tokenizer, prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)] if prompt else [[]]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt[0], str):
        return [tok.encode(p) if p else [] for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


# ---- shaping -------------------------------------------------------------------------------------


def _finish(st: GenState) -> tuple[str | None, int | str | None]:
    if st.finish_reason is None:
        return None, None
    kind = st.finish_reason.get("type")
    return kind, st.finish_reason.get("matched") if kind == "stop" else None


def _usage(reply: _Reply, states: list[GenState]) -> dict:
    firsts = states[:: reply.n]  # one per prompt: the n samples share it
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(len(s.output_ids) for s in states)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
        "reasoning_tokens": 0,
    }


def _metadata(states: list[GenState]) -> dict:
    end = sum(len(s.output_ids) for s in states)
    return {"weight_version": "default", "weight_versions": [{"version": "default", "start": 0, "end": end}]}


def _chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], tops: list) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = tok.token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for k, (t, lp) in enumerate(zip(ids, lps)):
        top = tops[k] if k < len(tops) else []
        content.append({**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]})
    return {"content": content}


def _completion_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], tops: list, offset0: int) -> dict:
    tokens = [tok.token_text(t) for t in ids[: len(lps)]]
    offsets, off = [], offset0
    for s in tokens:
        offsets.append(off)
        off += len(s)
    top = [{tok.token_text(t): lp for t, lp in tops[k]} for k in range(len(tops))] if tops else None
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def _logprobs(tok: Tokenizer, reply: _Reply, st: GenState, start: int, text_offset: int) -> dict | None:
    if not reply.logprobs:
        return None
    ids, lps, tops = st.output_ids[start:], st.logprobs[start:], st.top_logprobs[start:]
    if reply.chat:
        return _chat_logprobs(tok, ids, lps, tops)
    return _completion_logprobs(tok, ids, lps, tops, text_offset)


def _full_response(tok: Tokenizer, reply: _Reply, states: list[GenState]) -> dict:
    choices = []
    for i, st in enumerate(states):
        reason, matched = _finish(st)
        lp = _logprobs(tok, reply, st, 0, 0)
        if reply.chat:
            msg = {"role": "assistant", "content": st.text, "reasoning_content": None}
            choices.append(
                {"index": i, "message": msg, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
            )
        else:
            choices.append(
                {
                    "index": i,
                    "text": st.text,
                    "logprobs": lp,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
    return {
        "id": reply.id,
        "object": "chat.completion" if reply.chat else "text_completion",
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
        "usage": _usage(reply, states),
        "metadata": _metadata(states),
    }


def _chunk(reply: _Reply, choices: list[dict], usage: dict | None = None) -> bytes:
    return sse(
        {
            "id": reply.id,
            "object": "chat.completion.chunk" if reply.chat else "text_completion",
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
            "usage": usage,
        }
    )


def _choice_delta(reply: _Reply, i: int, text: str, lp: dict | None, reason: str | None, matched) -> dict:
    if reply.chat:
        return {
            "index": i,
            "delta": {"content": text},
            "logprobs": lp,
            "finish_reason": reason,
            "matched_stop": matched,
        }
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}


async def _stream(gw, reply: _Reply, inputs: list[GenInput]) -> AsyncIterator[bytes]:
    tok: Tokenizer = gw.tokenizer
    sent_ids = [0] * len(inputs)  # tokens already covered by logprobs, per choice
    sent_chars = [0] * len(inputs)
    finals: dict[int, GenState] = {}
    if reply.chat:
        for i in range(len(inputs)):
            first = {"role": "assistant", "content": ""}
            yield _chunk(
                reply,
                [{"index": i, "delta": first, "logprobs": None, "finish_reason": None, "matched_stop": None}],
            )
    try:
        async for i, st in merge_streams(gw.generations, inputs):
            if not (st.new_text or st.finished or (reply.logprobs and len(st.output_ids) > sent_ids[i])):
                continue
            reason, matched = _finish(st)
            lp = _logprobs(tok, reply, st, sent_ids[i], sent_chars[i])
            sent_ids[i], sent_chars[i] = len(st.output_ids), len(st.text)
            yield _chunk(reply, [_choice_delta(reply, i, st.new_text, lp, reason, matched)])
            if st.finished:
                finals[i] = st
    except ApiError as e:
        for i in range(len(inputs)):
            if i not in finals:
                yield _chunk(reply, [_choice_delta(reply, i, "", None, "abort", None)])
        yield sse(e.body())
        yield SSE_DONE
        return
    if reply.include_usage:
        states = [finals[i] for i in range(len(inputs))]
        yield _chunk(reply, [], _usage(reply, states))
    yield SSE_DONE
