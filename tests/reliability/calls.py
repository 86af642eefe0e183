"""Helpers for reliability tests: outcomes of plain and streamed calls, pool checks, cluster flags.

Every call ends in an `Outcome`: a complete response, or a clear error (an HTTP error with an
OpenAI-style body, or a stream whose last event before [DONE] is an error after an `abort` chunk).
Anything else (a hang, a stream cut short, a finish without [DONE]) fails the test.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

# Short protocol timeouts, generous waits: the machine is small and shared.
GATEWAY_FLAGS = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3", "--log-level", "warning"]
# The decode's wait for KV data covers the prefill's queue and forward too: under the load of these
# tests on two shared cores that takes seconds, so only the stall test uses a short transfer timeout.
TRANSFER_TIMEOUT_S = 20.0


def worker_flags(transfer_timeout_s: float = TRANSFER_TIMEOUT_S) -> list[str]:
    return [
        "--transfer-timeout",
        str(transfer_timeout_s),
        "--kv-wait-timeout",
        str(transfer_timeout_s),
        "--log-level",
        "warning",
    ]


WORKER_FLAGS = worker_flags()
PROMPT = "The three most important inventions of the last century are"


@dataclass
class Outcome:
    status: int
    ok: bool  # a complete response
    error: str = ""  # the error message when not ok
    output_ids: list[int] = field(default_factory=list)
    finish: dict | None = None
    meta: dict | None = None
    seconds: float = 0.0
    events: int = 0  # streamed chunks seen
    ended: float = field(default_factory=time.monotonic)  # when the call returned (monotonic clock)


def body(max_new_tokens: int, stream: bool = False, text: str = PROMPT) -> dict:
    return {
        "text": text,
        "stream": stream,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }


def _error_message(payload: object) -> str:
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
    msg = payload["error"]["message"]
    assert isinstance(msg, str) and msg, payload
    return msg


def generate(url: str, req: dict, timeout: float = 120.0) -> Outcome:
    """POST /generate (plain); raises on anything that is neither a full response nor a clear error."""
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", json=req, timeout=timeout)
    dt = time.monotonic() - t0
    if r.status_code != 200:
        return Outcome(r.status_code, False, _error_message(r.json()), seconds=dt)
    out = r.json()
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] in ("length", "stop"), out
    if fr["type"] == "length":
        assert len(out["output_ids"]) == req["sampling_params"]["max_new_tokens"], out
    return Outcome(200, True, "", out["output_ids"], fr, out["meta_info"], dt)


def stream(
    url: str, req: dict, timeout: float = 120.0, first_chunk=None, stop_after: int | None = None
) -> Outcome:
    """POST /generate with stream; `first_chunk()` is called once the first chunk arrived;
    `stop_after`: disconnect after that many chunks (the outcome is then `status=499`)."""
    t0 = time.monotonic()
    chunks: list[dict] = []
    done = False
    with httpx.stream("POST", url + "/generate", json={**req, "stream": True}, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return Outcome(r.status_code, False, _error_message(r.json()), seconds=time.monotonic() - t0)
        if stop_after == 0:
            return Outcome(499, False, "client disconnected", seconds=time.monotonic() - t0)
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
            if len(chunks) == 1 and first_chunk is not None:
                first_chunk()
            if stop_after is not None and len(chunks) >= stop_after:
                return Outcome(
                    499, False, "client disconnected", seconds=time.monotonic() - t0, events=len(chunks)
                )
    dt = time.monotonic() - t0
    assert done, f"stream ended without [DONE] after {len(chunks)} chunks"
    assert chunks, "a stream with no events"
    last = chunks[-1]
    if "error" in last:
        # The chunk before the error closes the generation with an abort and a message.
        assert len(chunks) >= 2, chunks
        fr = chunks[-2]["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and fr["message"], chunks[-2]
        return Outcome(200, False, _error_message(last), seconds=dt, events=len(chunks))
    fr = last["meta_info"]["finish_reason"]
    assert fr is not None and fr["type"] in ("length", "stop"), last
    if fr["type"] == "length":
        assert len(last["output_ids"]) == req["sampling_params"]["max_new_tokens"], last
    return Outcome(200, True, "", last["output_ids"], fr, last["meta_info"], dt, len(chunks))


def workers(url: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in httpx.get(url + "/workers", timeout=10).json()["workers"]}


def free_tokens(url: str) -> dict[str, int]:
    return {wid: w["free_tokens"] for wid, w in workers(url).items()}


def pool_sizes(url: str) -> dict[str, int]:
    """Each worker's KV pool in tokens: what it reports free when it holds nothing."""
    return {wid: w["max_total_tokens"] for wid, w in workers(url).items()}


def wait_pools(url: str, idle: dict[str, int], timeout_s: float = 30.0) -> dict[str, int]:
    """Wait until every worker named in `idle` reports that many free tokens again (heartbeats
    carry the load); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    now: dict[str, int] = {}
    while time.monotonic() < deadline:
        now = free_tokens(url)
        if all(now.get(w) == n for w, n in idle.items()):
            return now
        time.sleep(0.3)
    raise AssertionError(f"KV pools not back to idle within {timeout_s} s: idle {idle}, now {now}")


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
