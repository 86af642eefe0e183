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


def _metric(t: Target, name: str) -> float:
    text = httpx.get(t.url + "/metrics", headers=t.headers(admin=True), timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def disconnect_storm(t: Target) -> tuple[str, bool]:
    """24 clients that give up 0.05-0.4 s into a long prompt (6 at a time, within the client's limit
    beside the normal request). Each departure aborts both legs; the prefill's transfer then ends
    failed and is reported for a room already closed. Counted as transfer failures before (6 in a storm
    with none real); expected: the failures counter unchanged, each departure an abort."""
    fails, aborts = (
        "pdserve_kv_transfer_failures_total",
        'pdserve_request_aborts_total{reason="client_disconnect"}',
    )
    before = _metric(t, fails), _metric(t, aborts)
    text = "Tell me about the history of the printing press and its effect on science. " * 12
    body = {"text": text, "sampling_params": {"max_new_tokens": 64, "temperature": 0}}

    def leave(i: int) -> bool:
        try:
            httpx.post(t.url + "/generate", json=body, headers=t.headers(), timeout=0.05 + (i % 8) * 0.05)
        except httpx.TimeoutException:
            return True
        return False

    with ThreadPoolExecutor(6) as pool:
        left = sum(pool.map(leave, range(24)))
    deadline = time.monotonic() + 15
    while _metric(t, aborts) - before[1] < left - 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    failed, aborted = _metric(t, fails) - before[0], _metric(t, aborts) - before[1]
    answer = f"{left} left; transfer failures +{failed:.0f}, client aborts +{aborted:.0f}"
    return answer, failed == 0 and aborted >= left - 2


MESSAGES_400 = {
    "opens with assistant": {"messages": [{"role": "assistant", "content": "Hi"}]},
    "tool_use without an id": {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]},
        ]
    },
    "tool_result for an unknown id": {
        "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}
        ]
    },
    "duplicate tool names": {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 2,
    },
    "budget_tokens -5": {
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "enabled", "budget_tokens": -5},
    },
    "1 MB of thinking": {
        "messages": [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "x" * 1_000_000, "signature": ""}],
            },
            {"role": "user", "content": "Go on"},
        ]
    },
}


def invalid_messages(t: Target) -> tuple[str, bool]:
    """Six conversations Anthropic refuses (they were 200s, the thinking silently dropped), and a wrong
    key: each a 4xx in Anthropic's error shape (`{"type": "error", "error": {"type", "message"}}`)."""
    head = {"x-api-key": t.api_key, "anthropic-version": "2023-06-01"}
    model = httpx.get(t.url + "/v1/models", headers=t.headers(), timeout=30).json()["data"][0]["id"]
    codes, shaped = [], 0
    for case in [*MESSAGES_400.values(), None]:
        body = {
            "model": model,
            "max_tokens": 16,
            **(case or {"messages": [{"role": "user", "content": "Hi"}]}),
        }
        h = head if case is not None else {**head, "x-api-key": "wrong"}
        r = httpx.post(t.url + "/v1/messages", json=body, headers=h, timeout=60)
        codes.append(r.status_code)
        try:
            shaped += r.json().get("type") == "error" and "type" in r.json().get("error", {})
        except ValueError:
            pass
    answer = " ".join(map(str, codes)) + f"; {shaped}/{len(codes)} in Anthropic's shape"
    return answer, codes == [400] * len(MESSAGES_400) + [401] and shaped == len(codes)
