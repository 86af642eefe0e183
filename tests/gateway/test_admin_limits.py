"""The admin routes that take a body count against their client's limit, as generation does: a client
holding its slots with stalled admin requests gets 429s, and another client is let in meanwhile."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

ADMIN = {"Authorization": "Bearer admin-key"}


def _stalled(base: str, path: str) -> socket.socket:
    """An admin request whose headers are in and whose body never comes."""
    u = urlsplit(base)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer admin-key\r\n"
    s.sendall(head.encode() + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    return s


@pytest.mark.timeout(120)
def test_admin_routes_count_against_the_clients_limit(limited_gateway):
    base = limited_gateway
    held = [_stalled(base, "/abort_request"), _stalled(base, "/update_weights_from_disk")]
    time.sleep(0.5)  # both in, waiting for their bodies
    for path, body in (
        ("/abort_request", {"abort_all": True}),
        ("/workers/prefill-0/role", {"role": "decode"}),
        ("/pause_generation", {}),
        ("/flush_cache", None),
    ):
        r = httpx.post(base + path, json=body, headers=ADMIN, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", (path, r.text)
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    # Another client is let in meanwhile (the inference key may tokenize).
    other = httpx.post(
        base + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer user-key"}
    )
    assert other.status_code == 200, other.text
    for s in held:  # gone mid-body: their slots are given back
        s.close()
    deadline = time.monotonic() + 10
    while (
        r := httpx.post(base + "/abort_request", json={"abort_all": True}, headers=ADMIN)
    ).status_code == 429:
        assert time.monotonic() < deadline, "the slots of the requests that left were never given back"
        time.sleep(0.1)
    assert r.status_code == 200, r.text
