"""A request's body: read within its limits (size, time, the gateway-wide bytes in flight), then
parsed on the event loop when small and cheap, else in a worker thread (`parse_off_loop`), a few at
a time, with the garbage collector paused.

Why a thread is enough: the costly part of a hostile body is JSON decoding (C code holding the GIL)
and the collections it triggers. Bounded to 4 MiB (`--max-request-bytes`) and decoded with the
collector paused, a body of a million empty lists holds the GIL about 0.1 s at a time, where the
event loop used to stall 2.5 s (and 10-12 s at 31 MiB, long enough for workers to re-register).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from fastapi import Request

from pdserve.gateway.errors import ApiError, parse_json_body

T = TypeVar("T")

# Bodies up to this size are validated and tokenized on the event loop (at most a few thousand
# characters of prompt, well under a millisecond of work), unless they name an output constraint or
# tools, whose grammar is compiled while parsing.
INLINE_PARSE_BYTES = 4096
_COMPILED_KEYS = (
    b'"json_schema"',
    b'"regex"',
    b'"ebnf"',
    b'"response_format"',
    b'"tools"',
    b'"structural_tag"',
)
# Bigger bodies are parsed in worker threads, this many at once: JSON decoding is C code that holds
# the GIL throughout, so more threads would not parse faster, only stall the event loop longer.
PARSE_THREADS = 2


def parse_inline(raw: bytes) -> bool:
    """Whether a body is cheap enough to parse on the event loop (parsing a 128-token body through the
    thread took 0.41 ms, hop and validation together)."""
    return len(raw) <= INLINE_PARSE_BYTES and not any(k in raw for k in _COMPILED_KEYS)


class _GcPause:
    """Cyclic garbage collection paused while big bodies are decoded and checked: a body of a million
    empty lists triggers collections over every list made so far, 5x the decoding itself (0.5 s
    instead of 0.1 s for 4 MiB), all of it holding the GIL. Counted, as bodies may be parsed in
    several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._was_enabled:
                    gc.enable()


# One per process, as the collector it pauses.
gc_paused = _GcPause()


def parse_off_loop(parse: Callable[[dict[str, Any], float], T], raw: bytes, received: float) -> T:
    """`parse(decoded body, received)`, for a worker thread."""
    # The collector stays paused until the decoded body is dropped (when `parse` returns): resumed
    # earlier, its next collections would walk every container of the body again.
    with gc_paused():
        return parse(parse_json_body(raw), received)


class BodyBudget(Protocol):
    """The gateway-wide count of body bytes in flight (serving.Admission)."""

    def take_body(self, n: int) -> None: ...

    def give_body(self, n: int) -> None: ...


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than the limit of {limit} bytes ({limit / (1 << 20):g} MiB; "
        "--max-request-bytes)",
    )


async def read_body(
    request: Request, limit: int, timeout_s: float, budget: BodyBudget | None = None
) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed `limit` bytes, and
    with a 408 when it has not all arrived within `timeout_s`. With `budget`, its bytes are counted
    as they arrive (429 past the gateway-wide bound) and stay counted until the caller gives back
    `len(body)`; on a refusal, or a client gone mid-body, they are given back here."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            if size + len(chunk) > limit:
                raise _too_large(limit)
            if budget is not None:
                budget.take_body(len(chunk))
            size += len(chunk)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except BaseException as e:
        if budget is not None:
            budget.give_body(size)
        if isinstance(e, TimeoutError):
            raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
        raise
    return b"".join(chunks)
