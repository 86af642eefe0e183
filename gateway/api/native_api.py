"""SGLang's native API: POST (or PUT) /generate, plain and streaming, single prompts and batches.

In a batch, `sampling_params` may be one object for every prompt or a list with one per prompt.
With a reasoning parser configured, `meta_info.reasoning_tokens` counts the thinking tokens (the text
itself stays whole, as SGLang's native API returns it).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from typing_extensions import TypeIs

from pdserve.gateway.api.serving import SSE_DONE, check_generations, merge_streams, serve_generation, sse
from pdserve.gateway.api.state import GatewayState, gateway_state
from pdserve.gateway.errors import ApiError, bad_request
from pdserve.gateway.generation.generation import Generations, GenInput, GenState
from pdserve.gateway.protocol import build_sampling, derive_seed, parse_body, with_seed
from pdserve.gateway.request_models import GenerateBody
from pdserve.gateway.text.chat_output import reasoning_tokens
from pdserve.gateway.text.reasoning import reasoning_format
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.protocol.vocabulary import FinishReason, finish_abort

router = APIRouter()


@router.post("/generate")
@router.put("/generate", operation_id="generate_put")  # one OpenAPI operation id per method
async def generate(request: Request) -> Response:
    gw = gateway_state(request)

    batched = False  # a list in, a list out: batch prompts or n > 1
    text_in_logprobs = False

    def parse(raw: dict[str, Any], received: float) -> tuple[list[GenInput], bool, str]:
        nonlocal batched, text_in_logprobs
        body = parse_body(GenerateBody, raw)
        inputs, batched = _inputs(gw, body, received)
        text_in_logprobs = body.return_text_in_logprobs
        return inputs, body.stream, "text" if body.text is not None else "input_ids"

    def full(states: list[GenState]) -> object:
        out = [result(st, gw.tokenizer, gw.cfg.reasoning_parser) for st in states]
        if text_in_logprobs:
            for o in out:
                logprob_texts(o["meta_info"], gw.tokenizer)
        return out if batched else out[0]

    def chunks(inputs: list[GenInput]) -> AsyncGenerator[bytes, None]:
        return stream_chunks(gw.generations, inputs, batched, gw.tokenizer, gw.cfg.reasoning_parser)

    return await serve_generation(request, gw.admission, gw.generations, parse, full, chunks)


def _is_batch_ids(ids: object) -> TypeIs[list[list[int]]]:
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def _inputs(gw: GatewayState, body: GenerateBody, received: float) -> tuple[list[GenInput], bool]:
    # Counted before any prompt is tokenized: 400 prompts x n = 128 fit in a 16 KB body.
    if isinstance(body.sampling_params, list):
        count = sum(sp.n for sp in body.sampling_params)
    else:
        texts_or_ids = body.text if body.text is not None else body.input_ids
        batch = isinstance(body.text, list) or _is_batch_ids(texts_or_ids)
        count = body.sampling_params.n * (len(texts_or_ids or []) if batch else 1)
    check_generations(count, gw.cfg.max_generations_per_request)
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise bad_request("text is an empty list", "text")
        for t in texts:
            if t == "":
                raise bad_request("the prompt is empty", "text")
        ctx = gw.registry.context_length()
        prompts = [gw.tokenizer.encode(t, ctx, "text") for t in texts]
        batched = isinstance(body.text, list)
    else:
        ids = body.input_ids or []  # given: GenerateBody has exactly one of text and input_ids
        if _is_batch_ids(ids):
            batched, prompts = True, ids
        else:
            batched, prompts = False, [ids]
        if not prompts:
            raise bad_request("input_ids is empty", "input_ids")
    sps = (
        body.sampling_params
        if isinstance(body.sampling_params, list)
        else [body.sampling_params] * len(prompts)
    )
    if len(sps) != len(prompts):
        raise bad_request(
            f"sampling_params has {len(sps)} entries for {len(prompts)} prompts", "sampling_params"
        )
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise bad_request(f"rid has {len(rids)} entries for {len(prompts)} prompts", "rid")
    vocab = gw.tokenizer.vocab_size
    inputs = []
    for k, (p, rid, sp) in enumerate(zip(prompts, rids, sps)):
        param = f"sampling_params.{k}" if isinstance(body.sampling_params, list) else "sampling_params"
        sampling = build_sampling(
            sp, sp.max_new_tokens, body.return_logprob, body.top_logprobs_num, param, vocab
        )
        if body.return_logprob and body.logprob_start_len >= 0:  # prompt logprobs from this position on
            sampling = sampling.model_copy(update={"logprob_start_len": body.logprob_start_len})
        sampling = gw.constraints.apply(sampling, prefix=param)  # structured output
        for j in range(sp.n):
            seed = derive_seed(sampling.seed, j)
            base = rid or uuid.uuid4().hex
            inputs.append(
                GenInput(
                    rid=base if sp.n == 1 or rid is None else f"{base}-{j}",
                    input_ids=list(p),
                    sampling=with_seed(sampling, seed),
                    max_new_tokens_given=sp.max_new_tokens is not None,
                    received_ts=received,
                    skip_special_tokens=sp.skip_special_tokens,
                )
            )
    batched = batched or any(sp.n > 1 for sp in sps)
    return inputs, batched


def result(st: GenState, tok: Tokenizer | None = None, reasoning_parser: str | None = None) -> dict[str, Any]:
    fmt = reasoning_format(reasoning_parser, None)
    if tok is not None and fmt is not None and st.meta_info is not None:
        thought, _ = fmt.split(st.text)
        st.meta_info["reasoning_tokens"] = reasoning_tokens(tok, st.output_ids, fmt, thought)
    return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": st.meta_info}


def logprob_texts(meta: dict[str, Any] | None, tok: Tokenizer) -> None:
    """`return_text_in_logprobs`: each [logprob, token id, None] entry gets its token's text."""
    if not meta:
        return

    def fill(entry: list[Any]) -> None:
        entry[2] = tok.token_text(entry[1])

    for key in ("input_token_logprobs", "output_token_logprobs"):
        for e in meta.get(key) or []:
            fill(e)
    for key in ("input_top_logprobs", "output_top_logprobs"):
        for top in meta.get(key) or []:
            for e in top or []:
                fill(e)


def _partial_meta(st: GenState, finish_reason: FinishReason | None = None) -> dict[str, Any]:
    return {
        "id": st.rid,
        "finish_reason": finish_reason,
        "prompt_tokens": st.prompt_tokens,
        "weight_version": st.weight_versions[-1]["version"] if st.weight_versions else "default",
        "completion_tokens": len(st.output_ids),
        "cached_tokens": st.cached_tokens,
    }


async def stream_chunks(
    generations: Generations,
    inputs: list[GenInput],
    batched: bool,
    tok: Tokenizer | None = None,
    reasoning_parser: str | None = None,
) -> AsyncGenerator[bytes, None]:
    """Cumulative text and output_ids in every chunk (SGLang's default streaming), then [DONE]."""
    last: dict[int, GenState] = {}
    try:
        async for i, st in merge_streams(generations, inputs):
            last[i] = st
            if st.finished:
                chunk = result(st, tok, reasoning_parser)
            else:
                chunk = {**result(st), "meta_info": _partial_meta(st)}
            if batched:
                chunk["index"] = i
            yield sse(chunk)
    except ApiError as e:
        for i, inp in enumerate(inputs):
            seen = last.get(i)
            if seen is not None and seen.finished:
                continue
            st = seen or GenState(inp.rid, len(inp.input_ids))
            chunk = {**result(st), "meta_info": _partial_meta(st, finish_abort(e.message))}
            if batched:
                chunk["index"] = i
            yield sse(chunk)
        yield sse(e.body())
    yield SSE_DONE
