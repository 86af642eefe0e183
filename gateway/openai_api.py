"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models (SGLang's shapes).

A chat choice's text goes through `chat_output.ChatOutput` (reasoning parser, then tool-call parser)
whole or as a stream; tools and the tool-call history reach the prompt through function_call/prompt.py.
`model` must be the served name (or absent): another is a 404 `model_not_found`, as OpenAI answers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.gateway.chat_output import ChatDelta, ChatOutput, ChatOutputSpec, reasoning_tokens
from pdserve.gateway.errors import ApiError, bad_request, model_not_found
from pdserve.gateway.function_call import tool_call_format
from pdserve.gateway.function_call.prompt import chat_messages
from pdserve.gateway.function_call.schema import calls_from_constrained, tool_call_schema
from pdserve.gateway.generation import GenInput, GenState
from pdserve.gateway.protocol import (
    ChatCompletionBody,
    CompletionBody,
    NamedToolChoice,
    build_sampling,
    derive_seed,
    parse_body,
    with_seed,
)
from pdserve.gateway.reasoning import reasoning_format
from pdserve.gateway.serving import SSE_DONE, check_generations, merge_streams, serve_generation, sse
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
    output: ChatOutputSpec = ChatOutputSpec()
    # tool_choice "required" or a named function: a reply that is the constrained JSON is read as calls.
    forced_choice: str | NamedToolChoice | None = None
    stream_reasoning: bool = True
    # Completions with `echo`: each prompt's token ids, given back before its completion.
    echo: tuple[tuple[int, ...], ...] = ()


def _model_card(gw) -> dict:
    limits = gw.registry.limits()
    return {
        "id": gw.model_name,
        "object": "model",
        "created": gw.started,
        "owned_by": "pdserve",
        "root": gw.model_name,
        "max_model_len": limits.context_length if limits else None,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request.app.state.gw)]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> dict:
    gw = request.app.state.gw
    if model_id != gw.model_name:
        raise model_not_found(model_id)
    return _model_card(gw)


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
        if body.model is not None and body.model != gw.model_name:
            raise model_not_found(body.model)
        rid = body.rid or uuid.uuid4().hex
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        prompt_count = 1 if chat or isinstance(body.prompt, str) or _is_ids(body.prompt) else len(body.prompt)
        check_generations(prompt_count * body.n, gw.cfg.max_generations_per_request)
        skip_special = body.skip_special_tokens
        forced: str | NamedToolChoice | None = None
        if chat:
            ctx = gw.registry.context_length()
            prompts, param = [_chat_prompt(gw.tokenizer, gw.cfg.tool_call_parser, body, ctx)], "messages"
            max_new = (
                body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            )
            logprobs, top_n = body.logprobs, body.top_logprobs or 0
            spec = _output_spec(gw, body)
            if spec.tools is not None and gw.tokenizer.is_special(spec.tools.start):
                skip_special = False  # the parser must see the format's marker token
            forced = body.tool_choice if body.tool_choice == "required" else None
            if isinstance(body.tool_choice, NamedToolChoice):
                forced = body.tool_choice
            reply = _Reply(
                rid,
                int(received),
                gw.model_name,
                chat,
                body.n,
                logprobs,
                include_usage,
                spec,
                forced,
                body.stream_reasoning,
            )
        else:
            ctx = gw.registry.context_length()
            prompts, param = _completion_prompts(gw.tokenizer, body.prompt, ctx), "prompt"
            max_new, logprobs, top_n = body.max_tokens, body.logprobs is not None, body.logprobs or 0
            echo = tuple(tuple(p) for p in prompts) if body.echo else ()
            reply = _Reply(
                rid, int(received), gw.model_name, chat, body.n, logprobs, include_usage, echo=echo
            )
        sampling = build_sampling(body, max_new, logprobs, top_n, vocab_size=gw.tokenizer.vocab_size)
        if reply.echo and logprobs:  # the prompt's own logprobs too (what lm-eval's loglikelihood reads)
            sampling = sampling.model_copy(update={"logprob_start_len": 0})
        sampling = gw.constraints.apply(sampling, body.response_format)  # structured output
        if forced is not None and sampling.constraint is None and gw.constraints.backend_name != "none":
            # tool_choice "required" or a named function: the reply is constrained to a call
            # (function_call/schema.py), so that even a small model answers with a valid one.
            schema = json.dumps(tool_call_schema(body.tools or [], forced))
            sampling = gw.constraints.apply(
                sampling.model_copy(update={"json_schema": schema}), prefix="tools"
            )
        inputs = [
            _gen_input(
                f"{rid}-{i * body.n + j}",
                p,
                sampling,
                j,
                max_new is not None,
                received,
                skip_special,
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
    return GenInput(rid, list(ids), with_seed(sp, derive_seed(sp.seed, j)), given, received, skip)


# Arguments of apply_chat_template itself: a template variable must not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template"}
)


def _template_kwargs(body: ChatCompletionBody) -> dict:
    kwargs = dict(body.chat_template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def _chat_prompt(
    tok: Tokenizer, parser: str | None, body: ChatCompletionBody, max_tokens: int | None
) -> list[int]:
    msgs, tools = chat_messages(body, tool_call_format(parser), tok.template_supports_tools)
    kwargs = _template_kwargs(body)
    try:
        text = tok.chat_prompt(msgs, tools, kwargs)
    except Exception as e:  # jinja errors from the model's template (e.g. role order)
        raise bad_request(f"the chat template refused the messages: {e}", "messages") from None
    tok.check_chars(text, max_tokens, "messages")
    return tok.encode_rendered(text)


def _output_spec(gw, body: ChatCompletionBody) -> ChatOutputSpec:
    reasoning = None
    if body.separate_reasoning:
        reasoning = reasoning_format(gw.cfg.reasoning_parser, body.chat_template_kwargs)
    if not body.tools or body.tool_choice == "none":
        return ChatOutputSpec(reasoning=reasoning)
    names = [t.function.name for t in body.tools]
    if isinstance(body.tool_choice, NamedToolChoice):
        names = [body.tool_choice.function.name]
    return ChatOutputSpec(
        reasoning=reasoning,
        tools=tool_call_format(gw.cfg.tool_call_parser),
        tool_names=frozenset(names),
        parallel_tool_calls=body.parallel_tool_calls,
    )


def _is_ids(prompt: list) -> bool:
    """A completions prompt that is one list of token ids (not a batch)."""
    return bool(prompt) and isinstance(prompt[0], int)


def _completion_prompts(tok: Tokenizer, prompt: str | list, max_tokens: int | None) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt, max_tokens)] if prompt else [[]]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt[0], str):
        return [tok.encode(p, max_tokens) if p else [] for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


# ---- shaping -------------------------------------------------------------------------------------


def _finish(st: GenState, calls: bool = False) -> tuple[str | None, int | str | None]:
    if st.finish_reason is None:
        return None, None
    kind = st.finish_reason.get("type")
    matched = st.finish_reason.get("matched") if kind == "stop" else None
    if calls and kind == "stop":
        return "tool_calls", matched
    return kind, matched


def _usage(reply: _Reply, states: list[GenState], reasoning: list[int] | None = None) -> dict:
    firsts = states[:: reply.n]  # one per prompt: the n samples share it
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(len(s.output_ids) for s in states)
    thought = sum(reasoning or [])
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
        "completion_tokens_details": {"reasoning_tokens": thought},
        "reasoning_tokens": thought,
    }


def _metadata(states: list[GenState]) -> dict:
    """The choices' token ranges one after the other, as SGLang counts them; each version run one segment."""
    segs: list[dict] = []
    base = 0
    for s in states:
        for seg in s.weight_versions:
            start, end = base + seg["start"], base + seg["end"]
            if segs and segs[-1]["version"] == seg["version"] and segs[-1]["end"] == start:
                segs[-1]["end"] = end
            else:
                segs.append({"version": seg["version"], "start": start, "end": end})
        base += len(s.output_ids)
    return {"weight_version": segs[-1]["version"] if segs else "default", "weight_versions": segs}


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


def _chat_result(tok: Tokenizer, reply: _Reply, st: GenState) -> tuple[ChatDelta, int]:
    """A finished choice's reasoning, content and calls, and its reasoning tokens (also put in meta_info)."""
    out = ChatOutput(reply.output).whole(st.text)
    if not out.calls and reply.forced_choice is not None:
        # A reply constrained to the tool-call schema (function_call/schema.py) is bare JSON.
        calls = calls_from_constrained(out.content, reply.forced_choice)
        if calls:
            out = ChatDelta(out.reasoning, "", calls)
    fmt = reply.output.reasoning
    n = reasoning_tokens(tok, st.output_ids, fmt, out.reasoning) if fmt else 0
    if st.meta_info is not None:
        st.meta_info["reasoning_tokens"] = n
    return out, n


def _echoed(
    tok: Tokenizer, reply: _Reply, st: GenState, prompt: tuple[int, ...], lp: dict | None
) -> tuple[str, dict | None]:
    """`echo`: the prompt's text before the completion's, and its tokens' logprobs (the first is None,
    as OpenAI's) before the completion's, offsets running on."""
    head = tok.decode(list(prompt), False)
    if lp is None:
        return head + st.text, None
    lps = list(st.input_logprobs or [None] * len(prompt))
    tops = st.input_top_logprobs or [None] * len(prompt)
    tokens = [tok.token_text(t) for t in prompt]
    offsets, off = [], 0
    for s in tokens:
        offsets.append(off)
        off += len(s)
    top = None
    if lp.get("top_logprobs") is not None:
        top = [None if t is None else {tok.token_text(i): v for i, v in t} for t in tops]
        top += lp["top_logprobs"]
    return head + st.text, {
        "tokens": tokens + lp["tokens"],
        "token_logprobs": lps + lp["token_logprobs"],
        "top_logprobs": top,
        "text_offset": offsets + [len(head) + o for o in lp["text_offset"]],
    }


def _full_response(tok: Tokenizer, reply: _Reply, states: list[GenState]) -> dict:
    choices = []
    reasoning = []
    for i, st in enumerate(states):
        lp = _logprobs(tok, reply, st, 0, 0)
        if reply.chat:
            out, n = _chat_result(tok, reply, st)
            reasoning.append(n)
            reason, matched = _finish(st, bool(out.calls))
            msg = {
                "role": "assistant",
                "content": out.content if out.content or not out.calls else None,
                "reasoning_content": out.reasoning or None,
                "tool_calls": [c.openai() for c in out.calls] or None,
            }
            choices.append(
                {"index": i, "message": msg, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
            )
        else:
            reason, matched = _finish(st)
            text = st.text
            if reply.echo:
                text, lp = _echoed(tok, reply, st, reply.echo[i // reply.n], lp)
            choices.append(
                {
                    "index": i,
                    "text": text,
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
        "usage": _usage(reply, states, reasoning),
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


def _chat_delta(d: ChatDelta, first_call: int) -> dict:
    delta: dict = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.calls:
        delta["tool_calls"] = [{"index": first_call + k, **c.openai()} for k, c in enumerate(d.calls)]
    return delta


def _choice(reply: _Reply, i: int, delta: dict | str, lp: dict | None, reason: str | None, matched) -> dict:
    if reply.chat:
        body = {"index": i, "delta": delta}
    else:
        body = {"index": i, "text": delta}
    return {**body, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}


class _ChoiceStream:
    """One chat choice's stream: text deltas in, delta objects out.

    Reasoning is held back to the last chunk when `stream_reasoning` is false. Under a forced tool choice
    the content is held back too: the reply should be a call, and a reply that is the constrained JSON
    (function_call/schema.py) is only known to be one at the end; then the stream agrees with the whole reply.
    """

    def __init__(self, reply: _Reply) -> None:
        self.reply = reply
        self.out = ChatOutput(reply.output)
        self.n_calls = 0
        self.reasoning = ""  # all of it so far
        self.held_reasoning = ""
        self.held_content = ""

    def delta(self, text: str, final: bool) -> dict:
        d = self.out.feed(text)
        if final:
            end = self.out.finish()
            d = ChatDelta(d.reasoning + end.reasoning, d.content + end.content, d.calls + end.calls)
        self.reasoning += d.reasoning
        if not self.reply.stream_reasoning:  # all the reasoning in the last chunk
            self.held_reasoning += d.reasoning
            d.reasoning = self.held_reasoning if final else ""
        if self.reply.forced_choice is not None:
            self.held_content += d.content
            d.content = self.held_content if final else ""
            if final and not self.n_calls and not d.calls:
                calls = calls_from_constrained(self.held_content, self.reply.forced_choice)
                if calls:
                    d.content, d.calls = "", calls
        body = _chat_delta(d, self.n_calls)
        self.n_calls += len(d.calls)
        return body


async def _stream(gw, reply: _Reply, inputs: list[GenInput]) -> AsyncIterator[bytes]:
    tok: Tokenizer = gw.tokenizer
    sent_ids = [0] * len(inputs)  # tokens already covered by logprobs, per choice
    sent_chars = [0] * len(inputs)
    finals: dict[int, GenState] = {}
    parsers = [_ChoiceStream(reply) for _ in inputs]
    reasoning = [0] * len(inputs)
    if reply.chat:
        for i in range(len(inputs)):
            first = {"role": "assistant", "content": ""}
            yield _chunk(reply, [_choice(reply, i, first, None, None, None)])
    try:
        async for i, st in merge_streams(gw.generations, inputs):
            lp = None
            if reply.logprobs and len(st.output_ids) > sent_ids[i]:
                lp = _logprobs(tok, reply, st, sent_ids[i], sent_chars[i])
            delta: dict | str = st.new_text
            if reply.chat:
                delta = parsers[i].delta(st.new_text, st.finished)
                reason, matched = _finish(st, parsers[i].n_calls > 0)
                if st.finished and reply.output.reasoning:
                    reasoning[i] = reasoning_tokens(
                        tok, st.output_ids, reply.output.reasoning, parsers[i].reasoning
                    )
            else:
                reason, matched = _finish(st)
            if not (delta or st.finished or lp):
                continue
            sent_ids[i], sent_chars[i] = len(st.output_ids), len(st.text)
            yield _chunk(reply, [_choice(reply, i, delta, lp, reason, matched)])
            if st.finished:
                finals[i] = st
    except ApiError as e:
        for i in range(len(inputs)):
            if i not in finals:
                yield _chunk(reply, [_choice(reply, i, {} if reply.chat else "", None, "abort", None)])
        yield sse(e.body())
        yield SSE_DONE
        return
    if reply.include_usage:
        states = [finals[i] for i in range(len(inputs))]
        yield _chunk(reply, [], _usage(reply, states, reasoning))
    yield SSE_DONE
