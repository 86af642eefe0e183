"""The cost of HTTP API keys per request: the gateway's key check (gateway/api/auth.py) with keys and without,
alternating rounds in one process, over a bare ASGI app (the rest of a request costs the same either way).

    pdserve bench auth --requests 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from pdserve.gateway.api.auth import ApiKeyMiddleware, ApiKeys


async def _app(scope: dict, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _round(mw: ApiKeyMiddleware, headers: list[tuple[bytes, bytes]], n: int) -> float:
    """Microseconds per request."""
    scope = {"type": "http", "path": "/v1/chat/completions", "headers": headers}

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        pass

    t = time.perf_counter()
    for _ in range(n):
        await mw(scope, receive, send)
    return (time.perf_counter() - t) / n * 1e6


async def _bench(n: int, rounds: int) -> tuple[float, float]:
    key = "k" * 40
    off = ApiKeyMiddleware(_app, ApiKeys())
    on = ApiKeyMiddleware(_app, ApiKeys(api_key=key, admin_api_key="a" * 40))
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    without, with_keys = [], []
    for _ in range(rounds):
        without.append(await _round(off, headers, n))
        with_keys.append(await _round(on, headers, n))
    return statistics.median(without), statistics.median(with_keys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench auth", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20000, help="requests per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    a, b = asyncio.run(_bench(args.requests, args.rounds))
    print(f"per request: no keys {a:.2f} us, keys {b:.2f} us, the key check costs {b - a:.2f} us")
    return 0
