"""`pdserve bench abuse`, HTTP bodies and connections: what one client's bytes and sockets can do."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from pdserve.bench.abuse_target import (
    BODY_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    NORMAL,
    PER_CLIENT,
    Target,
    post,
    raw,
    status,
    wait_closed,
)

# ---- bodies and connections ------------------------------------------------------------------------


def huge_prompt(t: Target) -> tuple[str, bool]:
    return status(post(t, {"text": "a" * 3_000_000, "sampling_params": {"max_new_tokens": 1}}), 400)


def many_generations(t: Target) -> tuple[str, bool]:
    return status(post(t, {"text": ["hi"] * 400, "sampling_params": {"max_new_tokens": 1, "n": 128}}), 400)


def huge_body(t: Target) -> tuple[str, bool]:
    try:
        r = post(t, b'{"text": "' + b"a" * (33 << 20) + b'"}')
    except httpx.HTTPError as e:  # refused before the upload ended: the server may close first
        return f"connection closed during upload ({type(e).__name__})", True
    return status(r, 413)


def _empty_lists(size: int) -> bytes:
    n = (size - 30) // 3
    return b'{"text": "hi", "x": [' + b"[]," * n + b'[]], "sampling_params": {"max_new_tokens": 4}}'


def big_json_of_lists(t: Target) -> tuple[str, bool]:
    """31 MiB of empty lists (an unknown key): once parsed on the event loop for 10 s, freezing
    heartbeats; now refused by the body limit."""
    try:
        r = post(t, _empty_lists(31 << 20))
    except httpx.HTTPError as e:
        return f"connection closed during upload ({type(e).__name__})", True
    return status(r, 413)


def allowed_json_of_lists(t: Target) -> tuple[str, bool]:
    """Just under the default 4 MiB limit: parsed beside the event loop, served."""
    return status(post(t, _empty_lists((4 << 20) - 4096)), 200)


def deep_json(t: Target) -> tuple[str, bool]:
    return status(post(t, b'{"text": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400)


def huge_integer(t: Target) -> tuple[str, bool]:
    return status(post(t, b'{"input_ids": [' + b"9" * 5000 + b"]}"), 400)


def long_stop_strings(t: Target) -> tuple[str, bool]:
    return status(
        post(t, {"text": "hi", "sampling_params": {"max_new_tokens": 8, "stop": ["x" * 100_000] * 16}}), 400
    )


def allowed_stop_strings(t: Target) -> tuple[str, bool]:
    """The longest stop strings allowed, nearly matching all along: served, at a linear cost."""
    stops = ["a" * 1023 + chr(ord("b") + i) for i in range(16)]
    body = {"text": "a" * 200, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "stop": stops}}
    return status(post(t, body), 200)


def slow_body(t: Target) -> tuple[str, bool]:
    s = raw(t)
    auth = "".join(f"{k}: {v}\r\n" for k, v in t.headers().items()).encode()
    s.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + auth
        + b'Content-Length: 1000\r\n\r\n{"text": '
    )
    head = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    s.close()
    return head, " 408 " in head + " "


def stalled_big_bodies(t: Target) -> tuple[str, bool]:
    """24 bodies announced at 3.9 MiB each, 1 MiB sent, then stalled: each is given up at the body
    timeout and its memory freed (the RSS columns show it)."""
    auth = "".join(f"{k}: {v}\r\n" for k, v in t.headers().items()).encode()
    socks = []
    for _ in range(24):
        s = raw(t)
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + auth
            + f"Content-Length: {(4 << 20) - 100_000}\r\n\r\n".encode()
            + b'{"text": "'
            + b"a" * (1 << 20)
        )
        socks.append(s)
    closed = wait_closed(socks, BODY_TIMEOUT_S + 8)
    return f"{closed}/24 closed by the gateway", closed == 24


def idle_sockets(t: Target) -> tuple[str, bool]:
    socks = [raw(t) for _ in range(300)]
    closed = wait_closed(socks, IDLE_TIMEOUT_S + 5)
    return f"{closed}/300 closed by the gateway", closed == 300


def slowloris(t: Target) -> tuple[str, bool]:
    """50 connections sending their request headers one byte every 0.25 s."""
    socks = [raw(t) for _ in range(50)]
    stop = threading.Event()

    def drip() -> None:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000
        for i in range(len(head)):
            if stop.wait(0.25):
                return
            for s in socks:
                try:
                    s.send(head[i : i + 1])
                except OSError:
                    pass

    th = threading.Thread(target=drip, daemon=True)
    th.start()
    closed = wait_closed(socks, IDLE_TIMEOUT_S + 5)
    stop.set()
    th.join()
    return f"{closed}/50 closed by the gateway", closed == 50


def _flood(t: Target, spellings: list[str]) -> tuple[str, bool]:
    """40 requests at once from the client whose normal request is in flight: that request holds one of
    its slots, so at least PER_CLIENT - 1 of the 40 are let in (more as the first ones finish) and the
    rest get 429."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}

    def one(i: int) -> int:
        auth = spellings[i % len(spellings)]
        return post(t, body, headers={"Authorization": auth} if auth else None).status_code

    with ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(one, range(40)))
    counts = {c: codes.count(c) for c in sorted(set(codes))}
    answer = ", ".join(f"{n} x {c}" for c, n in counts.items())
    fair = set(counts) <= {200, 429} and counts.get(429, 0) > 0
    return answer, fair and counts.get(200, 0) >= PER_CLIENT - 1


def one_client_floods(t: Target) -> tuple[str, bool]:
    return _flood(t, [t.headers().get("Authorization", "")])


def respelled_keys_flood(t: Target) -> tuple[str, bool]:
    """The same key written eight ways counts as one client: when each spelling was a client of its
    own, 8 x PER_CLIENT slots let all 40 in."""
    k = t.api_key
    schemes = ["Bearer", "bearer", "BEARER", "BeArEr", "bEARER", "beaRER", "BEarer", "bearER"]
    return _flood(t, [f"{s}{' ' * (1 + i % 3)}{k}" for i, s in enumerate(schemes)] if k else [""])


def abandoned_streams(t: Target) -> tuple[str, bool]:
    """6 streams (within the client's limit, the normal request being its 7th), each dropped after its
    first chunk."""
    body = {**NORMAL, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

    def one(_: int) -> bool:
        with httpx.stream("POST", t.url + "/generate", json=body, timeout=60, headers=t.headers()) as r:
            for _chunk in r.iter_bytes():
                return r.status_code == 200
        return False

    with ThreadPoolExecutor(6) as pool:
        ok = sum(pool.map(one, range(6)))
    return f"{ok}/6 streams started, then dropped", ok == 6
