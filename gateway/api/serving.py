"""HTTP plumbing shared by the API handlers: admission, disconnects, fan-out, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pdserve.gateway.api.auth import request_key
from pdserve.gateway.api.request_body import PARSE_THREADS, parse_inline, parse_off_loop, read_body
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import ApiError, parse_json_body
from pdserve.gateway.generation.generation import Generations, GenInput, GenState
from pdserve.gateway.observe.metrics import GatewayMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# The parse pool's threads that the routes of `serve_body_work` may hold at once: a flood of them leaves
# the others to generation bodies, and a core to workers that share the gateway's machine.
WORK_THREADS = 1
# A list longer than this is serialized this many items at a time (`json_bytes`).
JSON_SLICE = 32768


def json_bytes(obj: dict[str, Any]) -> bytes:
    """`obj` as JSON (as JSONResponse writes it), its long top-level lists serialized in slices: the C
    encoder holds the GIL for a whole call (0.24 s for 663,552 tokens with their strings), and a thread
    building a big answer must leave the event loop its turns."""

    def value(v: Any) -> str:
        if not isinstance(v, list) or len(v) <= JSON_SLICE:
            return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
        items = (value(v[i : i + JSON_SLICE])[1:-1] for i in range(0, len(v), JSON_SLICE))
        return "[" + ",".join(items) + "]"

    return ("{" + ",".join(f"{json.dumps(k)}:{value(v)}" for k, v in obj.items()) + "}").encode()


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


class Admission:
    """What one client, and all clients together, may have in flight.

    Per client (its API key when it sends one, else its address): HTTP requests of the routes whose
    work grows with their body (generation, and the tokenizer's: `serve_body_work`), from the moment
    the headers are in, so that slow or stalled bodies hold only their own client's slots (429 beyond
    `per_client`). Across clients: generations (prompts x n), counted once the
    request is parsed (503 beyond `generations`), and the bytes of bodies being received or parsed
    (429 beyond `body_bytes`; 0: no limit); big bodies are parsed `PARSE_THREADS` at a time.
    """

    def __init__(
        self, generations: int, per_client: int, metrics: GatewayMetrics, body_bytes: int = 0
    ) -> None:
        self.limit = generations
        self.per_client = per_client
        self.pending = 0  # generations admitted
        self.requests = 0  # HTTP requests counted per client, in flight
        self.clients: dict[str, int] = {}
        self.metrics = metrics
        self.body_limit = body_bytes
        self.body_bytes = 0  # of bodies being received or parsed
        self.parse_slots = asyncio.Semaphore(PARSE_THREADS)
        self.work_slots = asyncio.Semaphore(WORK_THREADS)  # of the parse slots, for `serve_body_work`

    def take_body(self, n: int) -> None:
        """`n` more bytes of some request's body are held; 429 past the gateway-wide bound."""
        if self.body_limit and self.body_bytes + n > self.body_limit:
            self.metrics.rejected.labels("body_bytes").inc()
            raise ApiError(
                429,
                f"the gateway holds {self.body_bytes} bytes of request bodies in flight and this one "
                f"would pass its limit of {self.body_limit} bytes; retry later",
                headers={"Retry-After": "1"},
                code="rate_limit_exceeded",
            )
        self.body_bytes += n

    def give_body(self, n: int) -> None:
        self.body_bytes -= n

    def enter_client(self, client: str) -> None:
        n = self.clients.get(client, 0)
        if self.per_client and n >= self.per_client:
            self.metrics.rejected.labels("client_limit").inc()
            raise ApiError(
                429,
                f"this client already has {n} requests in flight, its limit; retry later",
                headers={"Retry-After": "1"},
                code="rate_limit_exceeded",
            )
        self.clients[client] = n + 1
        self.requests += 1
        self.metrics.pending.set(self.requests)

    def leave_client(self, client: str) -> None:
        n = self.clients.pop(client) - 1
        if n:
            self.clients[client] = n
        self.requests -= 1
        self.metrics.pending.set(self.requests)

    def enter(self, n: int) -> None:
        if n > self.limit:
            raise ApiError(
                400, f"the request asks for {n} generations; the gateway runs at most {self.limit} at once"
            )
        if self.pending + n > self.limit:
            self.metrics.rejected.labels("overloaded").inc()
            raise ApiError(
                503,
                f"the gateway is at its limit of {self.limit} pending generations; retry later",
                headers={"Retry-After": "1"},
            )
        self.pending += n
        self.metrics.pending_generations.set(self.pending)

    def leave(self, n: int) -> None:
        self.pending -= n
        self.metrics.pending_generations.set(self.pending)


def client_id(request: Request, keyed: bool) -> str:
    """Whom a request's limits count against: the API key it was let in with (hashed: never kept),
    read as the key check reads it (scheme in any case, blanks around the key ignored), when the
    gateway checks keys on generation paths (`keyed`); else its address (an unchecked bearer would
    make a new client at will)."""
    token = request_key(request.scope.get("headers", [])) if keyed else None
    if token:
        return "key:" + hashlib.sha256(token).hexdigest()[:16]
    return "addr:" + (request.client.host if request.client else "?")


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
    # (The ignores: Generations.generate, an async generator, is annotated AsyncIterator, which has no aclose.)
    async with contextlib.aclosing(generations.generate(inp)) as gen:  # type: ignore[type-var]
        async for st in gen:
            final = st
    assert final is not None and final.finished
    return final


async def collect_all(generations: Generations, inputs: list[GenInput]) -> list[GenState]:
    """All generations concurrently; the first failure cancels (and aborts) the others."""
    if len(inputs) == 1:  # no task of its own: one hop less on the way to the response
        return [await collect(generations, inputs[0])]
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

    A failure in one raises here (after the others are cancelled and aborted), always as an
    `ApiError`: the stream then ends with an error event and [DONE], never cut short.
    """
    if len(inputs) == 1:
        try:
            async with contextlib.aclosing(generations.generate(inputs[0])) as gen:  # type: ignore[type-var]
                async for st in gen:
                    yield 0, st
        except Exception as e:
            raise _as_api_error(e) from e
        return
    q: asyncio.Queue[tuple[int, GenState | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, inp: GenInput) -> None:
        try:
            async with contextlib.aclosing(generations.generate(inp)) as gen:  # type: ignore[type-var]
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
            elif isinstance(item, Exception):
                raise _as_api_error(item) from item
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _as_api_error(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    log.error("a stream's generation failed", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}")


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


def check_generations(count: int, limit: int) -> None:
    """A request's generations (prompts x n) within `limit`; parsers call it before tokenizing."""
    if count > limit:
        raise ApiError(400, f"the request asks for {count} generations (prompts x n); the limit is {limit}")


async def serve_generation(
    request: Request,
    admission: Admission,
    generations: Generations,
    parse: Callable[[dict[str, Any], float], tuple[list[GenInput], bool, str]],
    full: Callable[[list[GenState]], Any],
    chunks: Callable[[list[GenInput]], AsyncGenerator[bytes, None]],
) -> Response:
    """A generation request's life: the client's slot -> body -> parse/tokenize -> admit its
    generations -> check -> dispatch+collect -> respond.

    `parse(body, received_ts)` gives the generations to run, whether to stream, and the prompt's
    parameter name; `full` shapes the collected results; `chunks` shapes a stream (SSE bytes).
    """
    cfg = generations.cfg
    # Generation paths check keys when an inference key is set (auth.py); an admin key alone leaves
    # them open, and then any bearer would be a new client.
    client = client_id(request, bool(cfg.api_key))
    admission.enter_client(client)
    admitted = 0
    handed_to_stream = False
    try:
        received = time.time()
        raw = await read_body(request, cfg.max_request_bytes, cfg.request_body_timeout_s, admission)
        held = len(raw)
        try:
            # A big body is decoded, validated and tokenized off the event loop: it must not stall
            # heartbeats or other requests, nor must a grammar's compilation.
            if parse_inline(raw):
                inputs, stream, param = parse(parse_json_body(raw), received)
            else:
                async with admission.parse_slots:
                    inputs, stream, param = await asyncio.to_thread(parse_off_loop, parse, raw, received)
        finally:
            # The body is not needed past here (a plain request's frame lives until its answer).
            del raw
            admission.give_body(held)
        check_generations(len(inputs), cfg.max_generations_per_request)
        admission.enter(len(inputs))
        admitted = len(inputs)
        inputs = generations.prepare(inputs, param)
        traceparent = request.headers.get("traceparent")
        if traceparent and generations.tracing is not None:  # the client's trace: the root's parent
            inputs = [dataclasses.replace(i, traceparent=traceparent) for i in inputs]
        if stream:
            inputs = [dataclasses.replace(i, stream=True) for i in inputs]

            async def body() -> AsyncGenerator[bytes, None]:
                try:
                    async with contextlib.aclosing(chunks(inputs)) as it:
                        async for b in it:
                            yield b
                finally:
                    admission.leave(admitted)
                    admission.leave_client(client)

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
            admission.leave(admitted)
            admission.leave_client(client)


async def serve_body_work(
    request: Request, admission: Admission, cfg: GatewayConfig, work: Callable[[bytes], bytes]
) -> Response:
    """A request that is not a generation but whose work grows with its body (the tokenizer's routes),
    held to generation's limits: one of its client's slots (429 beyond `--max-requests-per-client`),
    the body within its size, time and gateway-wide bounds, then `work(body)` -> the answer's JSON
    bytes: on the event loop for a small body (`parse_inline`), else in one of the parse pool's threads
    (`WORK_THREADS` of them at most), decoding, computing and serializing all there."""
    async with client_slot(request, admission, cfg):
        raw = await read_body(request, cfg.max_request_bytes, cfg.request_body_timeout_s, admission)
        held = len(raw)
        try:
            if parse_inline(raw):
                out = work(raw)
            else:
                async with admission.work_slots, admission.parse_slots:
                    out = await asyncio.to_thread(work, raw)
        finally:
            del raw
            admission.give_body(held)
        # A large answer's buffers go back to the system once it is sent (see release_freed_heap).
        after = BackgroundTask(release_freed_heap) if len(out) > TRIM_AFTER_BYTES else None
        return Response(out, media_type="application/json", background=after)


# glibc keeps the freed memory of large answers in its heap (its mmap threshold rises after each large
# free): ten /tokenize answers of 663,552 token strings left the gateway 150 MiB larger for good.
TRIM_AFTER_BYTES = 8 << 20


def release_freed_heap() -> None:
    """Hand freed heap pages back to the system (glibc's malloc_trim; nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextlib.asynccontextmanager
async def client_slot(request: Request, admission: Admission, cfg: GatewayConfig) -> AsyncIterator[None]:
    """One of the request's client's slots (429 past `--max-requests-per-client`), held throughout."""
    client = client_id(request, bool(cfg.api_key))
    admission.enter_client(client)
    try:
        yield
    finally:
        admission.leave_client(client)
