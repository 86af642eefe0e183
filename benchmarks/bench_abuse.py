"""The abuse table: what one hostile or careless client can do to a running cluster.

Each case is sent while a normal streaming request runs. A row shows the answer the abusive client
got and how long it took, the gateway's memory before and after, the normal request's latency
during the case against its baseline, whether any worker left rotation, and whether the gateway and
the workers went back to idle afterwards.

    pdserve bench abuse                    # launches `pdserve up` with the limits below, prints the table
    pdserve bench abuse --url URL --gateway-pid PID   # against a running cluster with the same limits

The cluster's limits are set short so that the timeouts show within seconds (`LIMITS`); the defaults
are longer (60 s body, 30 s idle, 256 requests per client).
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

# `pdserve up` flags the cases below are written against.
PER_CLIENT = 8
BODY_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 2.0
LIMITS = [
    "--max-requests-per-client",
    str(PER_CLIENT),
    "--request-body-timeout",
    str(BODY_TIMEOUT_S),
    "--idle-timeout",
    str(IDLE_TIMEOUT_S),
]
NORMAL = {
    "text": "Write a short story about a lighthouse keeper.",
    "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
    "stream": True,
}


@dataclass
class Row:
    case: str
    answer: str  # what the abusive client saw
    ok: bool  # the answer is the expected one
    seconds: float  # until the abusive client had its answer (or its sockets were all closed)
    rss_before_mib: float
    rss_after_mib: float
    normal_s: float  # the normal request's latency during the case
    workers_kept: bool  # no worker left rotation or re-registered
    idle_after: bool  # the gateway's pending counts and every worker's queues back to 0


# ---- the cases: each sends its abuse and returns (answer, as expected) ------------------------------


def _post(url: str, body: bytes | dict, timeout: float = 60.0, headers: dict | None = None) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(url + "/generate", json=body, timeout=timeout, headers=headers)
    return httpx.post(
        url + "/generate",
        content=body,
        timeout=timeout,
        headers={"content-type": "application/json", **(headers or {})},
    )


def _status(r: httpx.Response, want: int) -> tuple[str, bool]:
    msg = ""
    if r.status_code >= 400:
        try:
            msg = ": " + r.json()["error"]["message"][:70]
        except (ValueError, KeyError, TypeError):
            msg = ""
    return f"{r.status_code}{msg}", r.status_code == want


def huge_prompt(url: str) -> tuple[str, bool]:
    return _status(_post(url, {"text": "a" * 10_000_000, "sampling_params": {"max_new_tokens": 1}}), 400)


def many_generations(url: str) -> tuple[str, bool]:
    body = {"text": ["hi"] * 400, "sampling_params": {"max_new_tokens": 1, "n": 128}}
    return _status(_post(url, body), 400)


def huge_body(url: str) -> tuple[str, bool]:
    body = b'{"text": "' + b"a" * (33 << 20) + b'"}'
    try:
        r = _post(url, body)
    except httpx.HTTPError as e:  # refused before the upload ended: the server may close first
        return f"connection closed during upload ({type(e).__name__})", True
    return _status(r, 413)


def deep_json(url: str) -> tuple[str, bool]:
    return _status(_post(url, b'{"text": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400)


def huge_integer(url: str) -> tuple[str, bool]:
    return _status(_post(url, b'{"input_ids": [' + b"9" * 5000 + b"]}"), 400)


def long_stop_strings(url: str) -> tuple[str, bool]:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 8, "stop": ["x" * 100_000] * 16}}
    return _status(_post(url, body), 400)


def allowed_stop_strings(url: str) -> tuple[str, bool]:
    """The longest stop strings allowed, nearly matching all along: served, at a linear cost."""
    stops = ["a" * 1023 + chr(ord("b") + i) for i in range(16)]
    body = {"text": "a" * 200, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "stop": stops}}
    return _status(_post(url, body), 200)


def _raw(url: str) -> socket.socket:
    u = urlsplit(url)
    return socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=30)


def slow_body(url: str) -> tuple[str, bool]:
    s = _raw(url)
    s.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"text": '
    )
    head = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    s.close()
    return head, " 408 " in head + " "


def _wait_closed(socks: list[socket.socket], timeout_s: float) -> int:
    """How many of `socks` the server closed within `timeout_s`."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + timeout_s
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(sock)
                closed += 1
    for s in socks:
        s.close()
    return closed


def idle_sockets(url: str) -> tuple[str, bool]:
    socks = [_raw(url) for _ in range(300)]
    closed = _wait_closed(socks, IDLE_TIMEOUT_S + 5)
    return f"{closed}/300 closed by the gateway", closed == 300


def slowloris(url: str) -> tuple[str, bool]:
    """50 connections sending their request headers one byte every 0.25 s."""
    socks = [_raw(url) for _ in range(50)]
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

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    closed = _wait_closed(socks, IDLE_TIMEOUT_S + 5)
    stop.set()
    t.join()
    return f"{closed}/50 closed by the gateway", closed == 50


def one_client_floods(url: str) -> tuple[str, bool]:
    """40 requests at once from the client whose normal request is in flight: that request holds one of
    its slots, so at least PER_CLIENT - 1 of the 40 are let in and the rest get 429."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
    with ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(lambda _: _post(url, body).status_code, range(40)))
    counts = {c: codes.count(c) for c in sorted(set(codes))}
    answer = ", ".join(f"{n} x {c}" for c, n in counts.items())
    return answer, set(counts) <= {200, 429} and counts.get(429, 0) > 0 and counts.get(
        200, 0
    ) >= PER_CLIENT - 1


def abandoned_streams(url: str) -> tuple[str, bool]:
    """6 streams (within the client's limit, the normal request being its 7th), each dropped after its
    first chunk."""
    body = {**NORMAL, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

    def one(_: int) -> bool:
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            for _chunk in r.iter_bytes():
                return r.status_code == 200
        return False

    with ThreadPoolExecutor(6) as pool:
        ok = sum(pool.map(one, range(6)))
    return f"{ok}/6 streams started, then dropped", ok == 6


CASES: list[tuple[str, Callable[[str], tuple[str, bool]]]] = [
    ("10M-character prompt", huge_prompt),
    ("400 prompts x n = 128 (16 KB body)", many_generations),
    ("33 MiB body", huge_body),
    ("100k-deep JSON", deep_json),
    ("5,000-digit integer", huge_integer),
    ("16 stop strings of 100k characters", long_stop_strings),
    ("16 stop strings of 1,024 characters (allowed)", allowed_stop_strings),
    ("body stalls after 10 bytes", slow_body),
    ("300 idle connections", idle_sockets),
    ("50 connections trickling headers", slowloris),
    ("one client, 40 requests at once", one_client_floods),
    ("6 streams dropped after one chunk", abandoned_streams),
]


# ---- measuring ------------------------------------------------------------------------------------


def normal_request(url: str) -> float:
    t = time.perf_counter()
    with httpx.stream("POST", url + "/generate", json=NORMAL, timeout=120) as r:
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass
    return time.perf_counter() - t


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        head = line.split(" ")[0]
        if head == name or head.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _workers(url: str) -> list[dict]:
    return list(httpx.get(url + "/workers", timeout=10).json()["workers"])


def _identity(workers: list[dict]) -> set[tuple]:
    return {(w["worker_id"], w["registered_at"], w["state"]) for w in workers}


def wait_idle(url: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = _metric(url, "pdserve_pending_requests") + _metric(url, "pdserve_pending_generations")
        busy += sum(w["queued"] + w["running"] for w in _workers(url))
        if busy == 0:
            return True
        time.sleep(0.25)
    return False


def _rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_case(url: str, gateway_pid: int | None, name: str, send: Callable[[str], tuple[str, bool]]) -> Row:
    before = _identity(_workers(url))
    rss0 = _rss_mib(gateway_pid)
    normal: list[float] = []
    t_normal = threading.Thread(target=lambda: normal.append(normal_request(url)))
    t_normal.start()
    time.sleep(0.2)  # the normal request is in flight
    t = time.perf_counter()
    try:
        answer, ok = send(url)
    except Exception as e:  # noqa: BLE001 - reported in the row
        answer, ok = f"client error: {type(e).__name__}: {e}"[:90], False
    seconds = time.perf_counter() - t
    t_normal.join(300)
    idle = wait_idle(url)
    return Row(
        case=name,
        answer=answer,
        ok=ok,
        seconds=seconds,
        rss_before_mib=rss0,
        rss_after_mib=_rss_mib(gateway_pid),
        normal_s=normal[0] if normal else float("nan"),
        workers_kept=_identity(_workers(url)) == before,
        idle_after=idle,
    )


def run_all(url: str, gateway_pid: int | None) -> tuple[float, list[Row]]:
    """The normal request's baseline (median of 3, after a warm-up) and one row per case."""
    normal_request(url)
    baseline = statistics.median(normal_request(url) for _ in range(3))
    return baseline, [run_case(url, gateway_pid, name, send) for name, send in CASES]


def format_table(baseline: float, rows: list[Row]) -> str:
    lines = [
        f"normal request (stream, 32 tokens) alone: {baseline:.2f} s",
        "",
        "| abuse | answer | time s | gateway RSS MiB | normal request s | workers kept | idle after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mark = "" if r.ok else " (UNEXPECTED)"
        lines.append(
            f"| {r.case} | {r.answer}{mark} | {r.seconds:.2f} | {r.rss_before_mib:.0f} -> {r.rss_after_mib:.0f} "
            f"| {r.normal_s:.2f} ({r.normal_s / baseline:.1f}x) | {'yes' if r.workers_kept else 'NO'} "
            f"| {'yes' if r.idle_after else 'NO'} |"
        )
    return "\n".join(lines)


def gateway_pid(launcher_pid: int) -> int | None:
    """The gateway process under a `pdserve up` launcher."""
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        if "gateway" in child.cmdline():
            return int(child.pid)
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser("pdserve bench abuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running cluster started with the limits in LIMITS (default: launch one)")
    ap.add_argument("--gateway-pid", type=int, help="with --url: the gateway's pid, for its memory")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.url:
        baseline, rows = run_all(args.url, args.gateway_pid)
    else:
        from pdserve.bench.bench_serving import launch, wait_healthy

        log_dir = tempfile.mkdtemp(prefix="pdserve-abuse-")
        port = 31700
        argv_up = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--port",
            str(port),
            "--log-dir",
            log_dir,
            *LIMITS,
        ]
        server = launch("pdserve", argv_up, port, log_dir)
        try:
            wait_healthy(server, 600)
            baseline, rows = run_all(server.url, gateway_pid(server.proc.pid))
        finally:
            server.stop()
    print(f"cluster limits: {' '.join(LIMITS)}")
    print(format_table(baseline, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline_s": baseline, "rows": [r.__dict__ for r in rows]}, f, indent=1)
    sys.exit(0 if all(r.ok and r.workers_kept and r.idle_after for r in rows) else 1)


if __name__ == "__main__":
    main()
