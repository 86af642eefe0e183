"""`pdserve bench abuse`, the routes beside generation whose work grows with their body: /tokenize and
/detokenize. Each is held to /generate's caps (a text of at most the context length x the tokenizer's
longest token, as many tokens at most), counts against the client's limit, and is computed and
serialized off the event loop; the cases poll /health meanwhile and report its slowest answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx

from pdserve.bench.abuse_target import PER_CLIENT, Target, status

T = TypeVar("T")
HEALTH_BOUND_S = 1.0  # /health slower than this during a case fails it


def _cap(t: Target) -> int:
    """The most characters a prompt may have, and the most tokens /tokenize returns: the cluster's
    context length x the served tokenizer's longest token."""
    from pdserve.gateway.text.tokenizer import Tokenizer  # transformers: only for these cases

    info = httpx.get(t.url + "/tokenizer_info", headers=t.headers(), timeout=30).json()
    return int(info["model_max_length"]) * Tokenizer.load(t.model_path or None).max_token_chars


def _with_health(t: Target, send: Callable[[], T]) -> tuple[T, float]:
    """`send()`'s result, and the slowest /health answer while it ran (polled every 50 ms)."""
    done = threading.Event()
    slowest = [0.0]

    def poll() -> None:
        with httpx.Client(timeout=60) as c:
            while not done.wait(0.05):
                t0 = time.perf_counter()
                c.get(t.url + "/health", headers=t.headers())
                slowest[0] = max(slowest[0], time.perf_counter() - t0)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        return send(), slowest[0]
    finally:
        done.set()
        poller.join(60)


def _tokenize(t: Target, body: dict, admin: bool = False) -> httpx.Response:
    return httpx.post(t.url + "/tokenize", json=body, headers=t.headers(admin), timeout=300)


def largest_tokenize_flood(t: Target) -> tuple[str, bool]:
    """The client's limit plus two of the largest /tokenize requests allowed, at once, with their token
    strings (two tokens a character: as many tokens as the cap allows, 663,552 for the bundled model).
    Built on the event loop, one held it 4.4-4.7 s and sixteen dropped both workers; the route was
    outside the per-client limit. Expected: the client's slots let in, the rest 429; /health within
    1 s throughout."""
    cap = _cap(t)
    body = {"prompt": "\U0001f642" * (cap // 2), "return_token_strs": True}
    n = PER_CLIENT + 2

    def flood() -> list[int]:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda _: _tokenize(t, body).status_code, range(n)))

    codes, slowest = _with_health(t, flood)
    counts = {c: codes.count(c) for c in sorted(set(codes))}
    answer = (
        ", ".join(f"{k} x {c}" for c, k in counts.items()) + f" ({cap} tokens); /health <= {slowest:.2f} s"
    )
    fair = set(counts) == {200, 429} and counts[200] >= PER_CLIENT - 1
    return answer, fair and slowest < HEALTH_BOUND_S


def million_ids_detokenize(t: Target) -> tuple[str, bool]:
    """/detokenize of 1M ids (2 MB): past the cap (as many ids as /tokenize may return), a 400 naming
    `tokens`, decided off the event loop. It was decoded, the ids checked on the loop (/health 1.1 s)."""
    body = b'{"tokens": [' + b"1," * 999_999 + b"1]}"

    def send() -> httpx.Response:
        h = {**t.headers(), "content-type": "application/json"}
        return httpx.post(t.url + "/detokenize", content=body, headers=h, timeout=120)

    r, slowest = _with_health(t, send)
    answer, ok = status(r, 400)
    ok = ok and r.json()["error"]["param"] == "tokens"
    return f"{answer[:60]}; /health <= {slowest:.2f} s", ok and slowest < HEALTH_BOUND_S


def tokenize_over_the_cap(t: Target) -> tuple[str, bool]:
    """A prompt one character past the cap (663,553 for the bundled model): a 400 naming `prompt`
    before it is tokenized. It was tokenized, whatever its length (2,000,001 tokens were returned)."""
    cap = _cap(t)
    r = _tokenize(t, {"prompt": "a" * (cap + 1), "return_token_strs": True})
    answer, ok = status(r, 400)
    return answer, ok and r.json()["error"]["param"] == "prompt"
