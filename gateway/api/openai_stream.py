"""The OpenAI streams: a request's generations as chat.completion.chunk / text_completion SSE events.

A chat choice's text goes through `chat_output.ChatOutput` as it comes (`_ChoiceStream`); a failure
mid-stream ends every unfinished choice with finish_reason "abort", then an error event and [DONE].
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from pdserve.gateway.api.openai_reply import Reply, finish_fields, token_logprobs, usage
from pdserve.gateway.api.serving import SSE_DONE, merge_streams, sse
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation.generation import Generations, GenInput, GenState
from pdserve.gateway.text.chat_output import ChatDelta, ChatOutput, reasoning_tokens
from pdserve.gateway.text.function_call.schema import calls_from_constrained
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.json_types import Json


def _chunk(reply: Reply, choices: list[Json], totals: Json | None = None) -> Json:
    return {
        "id": reply.id,
        "object": "chat.completion.chunk" if reply.chat else "text_completion",
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
        "usage": totals,
    }


def _chat_delta(d: ChatDelta, first_call: int) -> Json:
    delta: Json = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.calls:
        delta["tool_calls"] = [{"index": first_call + k, **c.openai()} for k, c in enumerate(d.calls)]
    return delta


def _choice(
    reply: Reply, i: int, delta: Json | str, lp: Json | None, reason: str | None, matched: int | str | None
) -> Json:
    body: Json = {"index": i, "delta": delta} if reply.chat else {"index": i, "text": delta}
    return {**body, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}


class _ChoiceStream:
    """One chat choice's stream: text deltas in, delta objects out.

    Reasoning is held back to the last chunk when `stream_reasoning` is false. Under a forced tool choice
    the content is held back too: the reply should be a call, and a reply that is the constrained JSON
    (function_call/schema.py) is only known to be one at the end; then the stream agrees with the whole reply.
    """

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.out = ChatOutput(reply.output)
        self.n_calls = 0
        self.reasoning = ""  # all of it so far
        self.held_reasoning = ""
        self.held_content = ""

    def delta(self, text: str, final: bool) -> Json:
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
                calls = calls_from_constrained(
                    self.held_content, self.reply.forced_choice, self.reply.output.parallel_tool_calls
                )
                if calls:
                    d.content, d.calls = "", calls
        body = _chat_delta(d, self.n_calls)
        self.n_calls += len(d.calls)
        return body


# One event of a stream: a chunk object, or the error that ended it (after its choices' "abort" chunks).
StreamEvent = Json | ApiError


async def stream_chunks(
    generations: Generations, tok: Tokenizer, reply: Reply, inputs: list[GenInput]
) -> AsyncGenerator[bytes, None]:
    """The SSE events of a request's generations (one choice each), then its usage if asked, then [DONE]."""
    async with contextlib.aclosing(chunk_objects(generations, tok, reply, inputs)) as events:
        async for ev in events:
            yield sse(ev.body() if isinstance(ev, ApiError) else ev)
    yield SSE_DONE


async def chunk_objects(
    generations: Generations, tok: Tokenizer, reply: Reply, inputs: list[GenInput]
) -> AsyncGenerator[StreamEvent, None]:
    """The chunk objects of a request's generations, then its usage chunk if asked; a failure ends
    every unfinished choice with "abort", then comes as the last event (the other APIs' streams are
    built on these: anthropic_api.py, responses_api.py)."""
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
        async for i, st in merge_streams(generations, inputs):
            lp = None
            if reply.logprobs and len(st.output_ids) > sent_ids[i]:
                lp = token_logprobs(tok, reply, st, sent_ids[i], sent_chars[i])
            delta: Json | str = st.new_text
            if reply.chat:
                delta = parsers[i].delta(st.new_text, st.finished)
                reason, matched = finish_fields(st, parsers[i].n_calls > 0)
                if st.finished and reply.output.reasoning:
                    reasoning[i] = reasoning_tokens(
                        tok, st.output_ids, reply.output.reasoning, parsers[i].reasoning
                    )
            else:
                reason, matched = finish_fields(st)
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
        yield e
        return
    if reply.include_usage:
        states = [finals[i] for i in range(len(inputs))]
        yield _chunk(reply, [], usage(reply, states, reasoning))
