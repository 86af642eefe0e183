"""A stuck KV transfer path: every request fails with a transfer error within the transfer timeout.

The prefill worker holds each finished prefill's KV back far longer than `--transfer-timeout`
(hidden test flag --test-stall-kv-send); the decode node gives up waiting, the gateway answers with
a clear error and aborts the prefill leg, and both pools return to idle.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import start_roles
from reliability.calls import GATEWAY_FLAGS, body, generate, pool_sizes, stream, wait_pools, worker_flags

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 3.0
STALL_S = 120.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_roles(
        tmp_path_factory.mktemp("stall"),
        [
            ("prefill", {}, [*worker_flags(TIMEOUT_S), "--test-stall-kv-send", str(STALL_S)]),
            ("decode", {}, worker_flags(TIMEOUT_S)),
        ],
        gateway_flags=GATEWAY_FLAGS,
    )
    try:
        c.wait_healthy(workers=2)
        yield c
    finally:
        c.stop()


def test_blocked_transfer_fails_within_the_timeout(cluster, record_property):
    c = cluster
    idle = pool_sizes(c.url)
    calls = [lambda: generate(c.url, body(8), 60), lambda: stream(c.url, body(8, stream=True), 60)] * 3
    t0 = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda f: f(), calls))
    slowest = max(o.seconds for o in outs)
    print(
        f"blocked transfer: {len(outs)} requests failed after {min(o.seconds for o in outs):.2f}-{slowest:.2f} s"
    )
    record_property("blocked_transfer_fail_s", slowest)
    for o in outs:
        assert not o.ok
        assert o.status in (503, 200)  # plain: 503; streamed: an abort chunk and an error event
        assert "transfer" in o.error and "timed out" in o.error, o.error
    # The timer starts once the page list reached the prefill node; allow for the handshake and a
    # loaded machine, but nowhere near the stall.
    assert slowest < TIMEOUT_S + 10, slowest
    assert time.monotonic() - t0 < STALL_S / 2
    wait_pools(c.url, idle)  # the held prefill pages were freed by the gateway's abort
