"""`pdserve bench abuse`, the workers: what one request's values, one grammar, one stopped or killed
process or one raw socket can do."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx

from pdserve.bench.abuse_target import Target, live_decode_pid, post, status

# ---- secrets, values, grammars, processes ---------------------------------------------------------


def server_info_secrets(t: Target) -> tuple[str, bool]:
    """Every info endpoint read with the inference key: neither key appears."""
    leaks = []
    for path in ("/get_server_info", "/server_info", "/get_model_info", "/v1/models"):
        r = httpx.get(t.url + path, headers=t.headers(), timeout=30)
        leaks += [path for k in (t.api_key, t.admin_key) if k and k in r.text]
    return (f"keys shown by {', '.join(leaks)}" if leaks else "no key in any body"), not leaks


def overflowing_values(t: Target) -> tuple[str, bool]:
    """The three bodies that overflowed int64 in the workers' sampling batch, three times each."""
    bodies = [
        {"top_k": 2**63},
        {"seed": 2**63 - 1, "n": 2},
        {"stop_token_ids": [2**63], "min_new_tokens": 1},
    ]
    codes = [
        post(t, {"text": "hi", "sampling_params": {"max_new_tokens": 2, **b}}).status_code
        for b in bodies
        for _ in range(3)
    ]
    return " ".join(map(str, codes)), all(c < 500 for c in codes)


def long_rid(t: Target) -> tuple[str, bool]:
    body = {"text": "hi", "rid": "r" * (1 << 20), "sampling_params": {"max_new_tokens": 1, "n": 128}}
    return status(post(t, body), 400)


def lone_surrogates(t: Target) -> tuple[str, bool]:
    """A lone surrogate in `stop`, `rid` and the prompt: a 400 each, before any room opens."""
    raw = [
        b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": ["\\udc00"]}}',
        b'{"text": "hi", "rid": "\\udc00", "sampling_params": {"max_new_tokens": 2}}',
        b'{"text": "hi \\udc00", "sampling_params": {"max_new_tokens": 2}}',
    ]
    codes = [post(t, b).status_code for b in raw]
    dash = httpx.get(t.url + "/dashboard/data", headers=t.headers(admin=True), timeout=30).status_code
    return f"{' '.join(map(str, codes))}; /dashboard/data {dash}", codes == [400] * 3 and dash == 200


def tiny_temperature(t: Target) -> tuple[str, bool]:
    """temperature 1e-38 is greedy, as in SGLang and vLLM: the same text as temperature 0."""
    outs = []
    for temp in (0, 1e-38):
        r = post(
            t,
            {
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 6, "temperature": temp},
            },
        )
        outs.append(r.json().get("text") if r.status_code == 200 else f"<{r.status_code}>")
    return f"{outs[1]!r}", outs[0] == outs[1] and bool(outs[0])


def _ebnf_classes(n: int) -> str:
    alts = " | ".join(f'"{chr(0x4E00 + i % 20000)}" [a-z0-9]' for i in range(n))
    return f"root ::= ({alts})+"


def heavy_grammar(t: Target) -> tuple[str, bool]:
    """An EBNF of 30k alternatives with character classes: compiled off the scheduler threads and the
    gateway's event loop, within --grammar-compile-timeout (served), or refused when past it (400)."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": _ebnf_classes(30_000)}}
    answer, _ = status(post(t, body, timeout=120), 200)
    return answer, answer.startswith(("200", "400"))


def stopped_prefill(t: Target) -> tuple[str, bool]:
    """SIGSTOP the prefill worker for 3.5 s (under the 5 s heartbeat timeout) during a 2k-token prefill: the decode keeps its turn at the
    cores (the normal stream goes on); the long request finishes after SIGCONT."""
    pid = t.pid("prefill")
    if pid is None:
        return "no prefill pid", False
    result: list[int] = []
    body = {"text": "lighthouse " * 2000, "sampling_params": {"max_new_tokens": 2}}
    th = threading.Thread(target=lambda: result.append(post(t, body, timeout=300).status_code))
    th.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    th.join(300)
    return f"long request {result[0] if result else 'no answer'}", result == [200]


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _listening_ports(pid: int) -> list[int]:
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return []
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})


def raw_worker_connects(t: Target) -> tuple[str, bool]:
    """300 raw TCP connections to every port each worker listens on (gloo, KV bootstrap, health),
    held 3 s and closed, then small requests (a KV hand-off each) for at most 20 s: each worker's
    descriptors come back to where they were (gloo keeps a raw connection until its group is rebuilt,
    which the pair's thread does within its 5 s check)."""
    parts, ok = [], True
    for name, pid in sorted(t.pids.items()):
        if name == "gateway":
            continue
        before = _fds(pid)
        socks = []
        for port in _listening_ports(pid):
            for _ in range(300):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                except OSError:
                    break
        time.sleep(3.0)
        for s in socks:
            s.close()
        deadline = time.monotonic() + 20
        while _fds(pid) > before + 8 and time.monotonic() < deadline:
            post(t, {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
            time.sleep(0.5)
        after = _fds(pid)
        ok &= 0 <= after <= before + 8
        parts.append(f"{name} {len(socks)} conns, fds {before} -> {after}")
    return "; ".join(parts), ok


def killed_worker_weight_update(t: Target) -> tuple[str, bool]:
    """kill -9 the decode, then ask for a weight update at once: the update fails within seconds naming
    the worker (it waited 600 s), and the restarted decode comes back on the current weights."""
    from pdserve.model_source import resolve_model_source

    pid = live_decode_pid(t)  # a case before this one may have restarted it
    if pid is None:
        return "no decode pid", False
    path = t.model_path or str(resolve_model_source(None).gguf_path)
    os.kill(pid, signal.SIGKILL)
    start = time.perf_counter()
    r = httpx.post(
        t.url + "/update_weights_from_disk",
        json={"model_path": path},
        headers=t.headers(admin=True),
        timeout=700,
    )
    took = time.perf_counter() - start
    try:
        msg = json.dumps(r.json())[:80]
    except ValueError:
        msg = r.text[:80]
    deadline = time.monotonic() + 180
    served = 0
    while time.monotonic() < deadline:
        served = post(t, {"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code
        if served == 200:
            break
        time.sleep(2)
    return f"{r.status_code} in {took:.1f} s ({msg}); then {served}", took < 30 and served == 200
