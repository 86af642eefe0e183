"""Clients that walk away mid-request are aborts, not failures: a storm of disconnects (real gateway,
prefill and decode workers, the bundled model) leaves `pdserve_kv_transfer_failures_total` at 0 and
counts each departure in `pdserve_request_aborts_total{reason="client_disconnect"}`.

A client that leaves while its prompt's KV is on the way makes the gateway abort both legs; the
prefill worker's transfer then ends failed and the worker reports it, for a room the gateway has
closed already: that report is the echo of the abort, not a failed transfer.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_roles
from reliability.calls import GATEWAY_FLAGS, WORKER_FLAGS, body, generate, metric, pool_sizes, wait_pools

pytestmark = pytest.mark.timeout(400)

# Long enough that the prefill's forward and the KV transfer take a while on two shared cores.
LONG = "Tell me about the history of the printing press and its effect on science. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_roles(
        tmp_path_factory.mktemp("aborts"),
        [("prefill", {}, WORKER_FLAGS), ("decode", {}, WORKER_FLAGS)],
        gateway_flags=GATEWAY_FLAGS,
    )
    try:
        c.wait_healthy(workers=2)
        c.idle = pool_sizes(c.url)
        yield c
    finally:
        c.stop()


def _leave(url: str, patience: float) -> bool:
    """A plain request whose client gives up after `patience` seconds; whether it did."""
    try:
        r = httpx.post(url + "/generate", json=body(64, text=LONG), timeout=patience)
    except httpx.TimeoutException:
        return True
    assert r.status_code == 200, r.text  # served in full before the client gave up: not a failure
    return False


def test_a_disconnect_storm_counts_aborts_not_transfer_failures(cluster):
    c = cluster
    assert generate(c.url, body(4, text=LONG)).ok  # warm
    rng = random.Random(1)
    # Patience spread over the prefill's queue, its forward and the transfer.
    patience = [rng.uniform(0.1, 2.5) for _ in range(40)]
    with ThreadPoolExecutor(6) as pool:
        left = sum(pool.map(lambda p: _leave(c.url, p), patience))
    assert left >= 20, left
    wait_pools(c.url, c.idle)
    deadline = time.monotonic() + 10
    while metric(c.url, "pdserve_pending_requests") and time.monotonic() < deadline:
        time.sleep(0.2)
    aborted = metric(c.url, "pdserve_aborted_legs_total")
    assert aborted >= left, aborted  # the gateway aborted their legs on the workers
    assert metric(c.url, "pdserve_kv_transfer_failures_total") == 0
    # Each departure is one abort (one seen by the gateway: a reply may beat the client's timeout).
    disconnects = metric(c.url, 'pdserve_request_aborts_total{reason="client_disconnect"}')
    assert left - 2 <= disconnects <= left, (disconnects, left)
    assert generate(c.url, body(6)).ok  # and the cluster still serves
