"""HTTP plumbing shared by the API handlers: admission, disconnects, fan-out, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.gateway.errors import ApiError, parse_json_body
from pdserve.gateway.generation import Generations, GenInput, GenState
from pdserve.gateway.metrics import GatewayMetrics

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


class Admission:
    """Bounds in-flight HTTP generation requests; beyond the bound, 503 at once."""

    def __init__(self, limit: int, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.pending = 0
        self.metrics = metrics

    def enter(self) -> None:
        if self.pending >= self.limit:
            self.metrics.rejected.labels("overloaded").inc()
            raise ApiError(
                503,
                f"the gateway is at its limit of {self.limit} pending requests; retry later",
                headers={"Retry-After": "1"},
            )
        self.pending += 1
        self.metrics.pending.set(self.pending)

    def leave(self) -> None:
        self.pending -= 1
        self.metrics.pending.set(self.pending)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (its generations abort both legs)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise ClientGone()
    return task.result()


async def collect(generations: Generations, inp: GenInput) -> GenState:
    """Run one generation to its end."""
    final: GenState | None = None
    async with contextlib.aclosing(generations.generate(inp)) as gen:
        async for st in gen:
            final = st
    assert final is not None and final.finished
    return final


async def collect_all(generations: Generations, inputs: list[GenInput]) -> list[GenState]:
    """All generations concurrently; the first failure cancels (and aborts) the others."""
    tasks = [asyncio.ensure_future(collect(generations, inp)) for inp in inputs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge_streams(
    generations: Generations, inputs: list[GenInput]
) -> AsyncIterator[tuple[int, GenState]]:
    """Interleave several generations' steps as they come, tagged with their index.

    A failure in one raises here (after the others are cancelled and aborted).
    """
    if len(inputs) == 1:
        async with contextlib.aclosing(generations.generate(inputs[0])) as gen:
            async for st in gen:
                yield 0, st
        return
    q: asyncio.Queue[tuple[int, GenState | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, inp: GenInput) -> None:
        try:
            async with contextlib.aclosing(generations.generate(inp)) as gen:
                async for st in gen:
                    # The state object is mutated by the next step: hand out a snapshot of the deltas.
                    await q.put((i, _snapshot(st)))
            await q.put((i, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inputs)]
    live = len(tasks)
    try:
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _snapshot(st: GenState) -> GenState:
    return GenState(
        rid=st.rid,
        prompt_tokens=st.prompt_tokens,
        output_ids=list(st.output_ids),
        text=st.text,
        logprobs=list(st.logprobs),
        top_logprobs=list(st.top_logprobs),
        new_text=st.new_text,
        new_ids=st.new_ids,
        finished=st.finished,
        finish_reason=st.finish_reason,
        meta_info=st.meta_info,
        cached_tokens=st.cached_tokens,
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def serve_generation(
    request: Request,
    admission: Admission,
    generations: Generations,
    parse: Callable[[dict, float], tuple[list[GenInput], bool, str]],
    full: Callable[[list[GenState]], Any],
    chunks: Callable[[list[GenInput]], AsyncIterator[bytes]],
) -> Response:
    """A generation request's life: admit -> parse/tokenize -> check -> dispatch+collect -> respond.

    `parse(body, received_ts)` gives the generations to run, whether to stream, and the prompt's
    parameter name; `full` shapes the collected results; `chunks` shapes a stream (SSE bytes).
    """
    admission.enter()
    handed_to_stream = False
    try:
        received = time.time()
        raw = await read_body(request, generations.cfg.max_request_bytes)
        # Off the event loop: a huge prompt's tokenization must not stall heartbeats or other requests.
        inputs, stream, param = await asyncio.to_thread(parse, parse_json_body(raw), received)
        limit = generations.cfg.max_generations_per_request
        if len(inputs) > limit:
            raise ApiError(
                400, f"the request asks for {len(inputs)} generations (prompts x n); the limit is {limit}"
            )
        inputs = generations.prepare(inputs, param)
        traceparent = request.headers.get("traceparent")
        if traceparent and generations.tracing is not None:  # the client's trace: the root's parent
            inputs = [dataclasses.replace(i, traceparent=traceparent) for i in inputs]
        if stream:

            async def body() -> AsyncIterator[bytes]:
                try:
                    async with contextlib.aclosing(chunks(inputs)) as it:
                        async for b in it:
                            yield b
                finally:
                    admission.leave()

            handed_to_stream = True
            return StreamingResponse(
                body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            states = await until_disconnect(request, collect_all(generations, inputs))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(full(states))
    finally:
        if not handed_to_stream:
            admission.leave()
