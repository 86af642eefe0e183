"""Routes beside generation that take a body count against their client's limit too.

Generation and the tokenizer routes take their client's slot in `serve_generation` / `serve_body_work`
(gateway/api/serving.py). The admin routes (weights, abort, role switch, cache flush) take one through
`counted`, from their headers on until their answer: a client that holds its slots with stalled or
slow admin requests is answered 429 like any other, and cannot hold more of the gateway than its limit.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from pdserve.gateway.api.serving import client_slot
from pdserve.gateway.api.state import gateway_state

R = TypeVar("R")


def counted(route: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """`route` (a FastAPI endpoint taking `request: Request`) holding one of its client's slots."""

    @functools.wraps(route)  # FastAPI reads the wrapped signature: the same parameters are passed in
    async def wrapped(*args: Any, request: Request, **kwargs: Any) -> R:
        gw = gateway_state(request)
        async with client_slot(request, gw.admission, gw.cfg):
            return await route(*args, request=request, **kwargs)

    return wrapped
