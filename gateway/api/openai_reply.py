"""The OpenAI responses' shapes: what a request's replies share (`Reply`), and the whole (non-streamed)
chat.completion / text_completion object built from its finished generations (`full_response`).

The parts a stream's chunks carry too (finish reason, usage, logprobs) are built here as well;
openai_stream.py shapes the chunks themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.gateway.generation.generation import GenState
from pdserve.gateway.request_models import NamedToolChoice
from pdserve.gateway.text.chat_output import ChatDelta, ChatOutput, ChatOutputSpec, reasoning_tokens
from pdserve.gateway.text.function_call.schema import calls_from_constrained
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.json_types import Json

TopLogprobs = list[list[tuple[int, float]]]


@dataclass(frozen=True)
class Reply:
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
    strict_metadata: bool = False  # --strict-openai-metadata


def finish_fields(st: GenState, calls: bool = False) -> tuple[str | None, int | str | None]:
    """A choice's `finish_reason` and `matched_stop` (a stop that ended in tool calls: "tool_calls")."""
    if st.finish_reason is None:
        return None, None
    fr = st.finish_reason
    matched = fr["matched"] if fr["type"] == "stop" else None
    if calls and fr["type"] == "stop":
        return "tool_calls", matched
    return fr["type"], matched


def usage(reply: Reply, states: list[GenState], reasoning: list[int] | None = None) -> Json:
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


def weight_segments(states: list[GenState]) -> list[Json]:
    """The choices' token ranges one after the other, as SGLang counts them; each version run one segment."""
    segs: list[Json] = []
    base = 0
    for s in states:
        for seg in s.weight_versions:
            start, end = base + seg["start"], base + seg["end"]
            if segs and segs[-1]["version"] == seg["version"] and segs[-1]["end"] == start:
                segs[-1]["end"] = end
            else:
                segs.append({"version": seg["version"], "start": start, "end": end})
        base += len(s.output_ids)
    return segs


def version_fields(segs: list[Json], strict: bool) -> Json:
    """A response's `metadata`: the weight version of the last token and, as the seed has it, the
    per-token segments. `strict` (--strict-openai-metadata): `metadata` is OpenAI's map of strings, and
    the segments sit beside it in the pdserve field `weight_versions`, which typed clients ignore."""
    last = {"weight_version": segs[-1]["version"] if segs else "default"}
    if strict:
        return {"metadata": last, "weight_versions": segs}
    return {"metadata": {**last, "weight_versions": segs}}


def _chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], tops: TopLogprobs) -> Json:
    def entry(t: int, lp: float) -> Json:
        s = tok.token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for k, (t, lp) in enumerate(zip(ids, lps)):
        top = tops[k] if k < len(tops) else []
        content.append({**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]})
    return {"content": content}


def _completion_logprobs(
    tok: Tokenizer, ids: list[int], lps: list[float], tops: TopLogprobs, offset0: int
) -> Json:
    tokens = [tok.token_text(t) for t in ids[: len(lps)]]
    offsets, off = [], offset0
    for s in tokens:
        offsets.append(off)
        off += len(s)
    top = [{tok.token_text(t): lp for t, lp in tops[k]} for k in range(len(tops))] if tops else None
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def token_logprobs(tok: Tokenizer, reply: Reply, st: GenState, start: int, text_offset: int) -> Json | None:
    """The logprobs of a choice's output tokens from `start` on, in the chat or the completions shape."""
    if not reply.logprobs:
        return None
    ids, lps, tops = st.output_ids[start:], st.logprobs[start:], st.top_logprobs[start:]
    if reply.chat:
        return _chat_logprobs(tok, ids, lps, tops)
    return _completion_logprobs(tok, ids, lps, tops, text_offset)


def _chat_result(tok: Tokenizer, reply: Reply, st: GenState) -> tuple[ChatDelta, int]:
    """A finished choice's reasoning, content and calls, and its reasoning tokens (also put in meta_info)."""
    out = ChatOutput(reply.output).whole(st.text)
    if not out.calls and reply.forced_choice is not None:
        # A reply constrained to the tool-call schema (function_call/schema.py) is bare JSON.
        calls = calls_from_constrained(out.content, reply.forced_choice, reply.output.parallel_tool_calls)
        if calls:
            out = ChatDelta(out.reasoning, "", calls)
    fmt = reply.output.reasoning
    n = reasoning_tokens(tok, st.output_ids, fmt, out.reasoning) if fmt else 0
    if st.meta_info is not None:
        st.meta_info["reasoning_tokens"] = n
    return out, n


def _echoed(
    tok: Tokenizer, st: GenState, prompt: tuple[int, ...], lp: Json | None
) -> tuple[str, Json | None]:
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


def _chat_choice(tok: Tokenizer, reply: Reply, i: int, st: GenState) -> tuple[Json, int]:
    """A finished chat choice, and its reasoning tokens."""
    lp = token_logprobs(tok, reply, st, 0, 0)
    out, n = _chat_result(tok, reply, st)
    reason, matched = finish_fields(st, bool(out.calls))
    msg = {
        "role": "assistant",
        "content": out.content if out.content or not out.calls else None,
        "reasoning_content": out.reasoning or None,
        "tool_calls": [c.openai() for c in out.calls] or None,
    }
    choice = {"index": i, "message": msg, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
    return choice, n


def _completion_choice(tok: Tokenizer, reply: Reply, i: int, st: GenState) -> Json:
    lp = token_logprobs(tok, reply, st, 0, 0)
    reason, matched = finish_fields(st)
    text = st.text
    if reply.echo:
        text, lp = _echoed(tok, st, reply.echo[i // reply.n], lp)
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}


def full_response(tok: Tokenizer, reply: Reply, states: list[GenState]) -> Json:
    """The whole chat.completion or text_completion object of a request's finished generations."""
    choices = []
    reasoning = []
    segs = weight_segments(states)
    for i, st in enumerate(states):
        if reply.chat:
            choice, n = _chat_choice(tok, reply, i, st)
            choices.append(choice)
            reasoning.append(n)
        else:
            choices.append(_completion_choice(tok, reply, i, st))
    return {
        "id": reply.id,
        "object": "chat.completion" if reply.chat else "text_completion",
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
        "usage": usage(reply, states, reasoning),
        **version_fields(segs, reply.strict_metadata),
    }
