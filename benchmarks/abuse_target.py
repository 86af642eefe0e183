"""What every case of `pdserve bench abuse` shares: the `Target` it attacks and the client helpers.

A case takes the `Target` (the cluster's URL, its two API keys, the process ids under `pdserve up`)
and returns (the answer the abusive client saw, whether that answer is the expected one). The cases
about HTTP bodies and connections are in abuse_http.py; those about what one request's values, one
grammar, one stopped or killed process or one raw socket can do to the workers in abuse_workers.py;
the list of both in abuse_cases.py.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

PER_CLIENT = 8  # `pdserve up --max-requests-per-client`
BODY_TIMEOUT_S = 2.0  # `--request-body-timeout`
IDLE_TIMEOUT_S = 2.0  # `--idle-timeout`
NORMAL = {
    "text": "Write a short story about a lighthouse keeper.",
    "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
    "stream": True,
}


@dataclass(frozen=True)
class Target:
    """A cluster under test: its URL, its keys, and the pids `pdserve up` started (for the cases that
    stop, kill or count the descriptors of a process)."""

    url: str
    api_key: str = ""
    admin_key: str = ""
    pids: dict[str, int] = field(default_factory=dict)  # "gateway", "prefill-0", "decode-0", ...
    model_path: str = ""  # the served checkpoint (default: the bundled model), for the weight update case

    def headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_key if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def pid(self, role: str) -> int | None:
        return next((p for name, p in sorted(self.pids.items()) if name.startswith(role)), None)


Case = Callable[[Target], tuple[str, bool]]


def post(t: Target, body: bytes | dict, timeout: float = 60.0, headers: dict | None = None) -> httpx.Response:
    h = {**t.headers(), **(headers or {})}
    if isinstance(body, dict):
        return httpx.post(t.url + "/generate", json=body, timeout=timeout, headers=h)
    return httpx.post(
        t.url + "/generate", content=body, timeout=timeout, headers={"content-type": "application/json", **h}
    )


def status(r: httpx.Response, want: int) -> tuple[str, bool]:
    msg = ""
    if r.status_code >= 400:
        try:
            msg = ": " + r.json()["error"]["message"][:70]
        except (ValueError, KeyError, TypeError):
            msg = ""
    return f"{r.status_code}{msg}", r.status_code == want


def raw(t: Target) -> socket.socket:
    u = urlsplit(t.url)
    return socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=30)


def wait_closed(socks: list[socket.socket], timeout_s: float) -> int:
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


def cmdline_of(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def live_decode_pid(t: Target) -> int | None:
    """This cluster's running decode worker: a child of the `pdserve up` that started the gateway (the
    pid `pdserve up` gave it first may be dead: a case before this one restarted it)."""
    import psutil

    gateway = t.pids.get("gateway")
    if gateway is None:
        return None
    try:
        launcher = psutil.Process(psutil.Process(gateway).ppid())
        if launcher.pid == 1 or "pdserve" not in " ".join(launcher.cmdline()):
            return None  # the gateway was orphaned: nothing tells this cluster's workers apart
        children = launcher.children(recursive=True)
    except psutil.Error:
        return None
    for child in sorted(children, key=lambda c: c.pid):
        cmd = cmdline_of(child.pid)
        if "pdserve.cli" in cmd and cmd[cmd.index("pdserve.cli") + 1 :][:1] == ["decode"]:
            return int(child.pid)
    return None
