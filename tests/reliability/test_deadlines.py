"""Workers end requests past their deadline by themselves, on both legs, and free their pages.

Both workers' clocks run 8 s ahead (hidden flag --test-clock-skew), so they see the deadline the
gateway stamps (received + `--request-timeout` 12 s) pass 4 s after a request arrives, well before
the gateway's own timer: a request that ends within the 12 s was ended by a worker. The client
sees the gateway's timeout error either way.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import start_roles
from reliability.calls import (
    GATEWAY_FLAGS,
    PROMPT,
    WORKER_FLAGS,
    body,
    generate,
    pool_sizes,
    stream,
    wait_pools,
)

# Minutes of real clusters killed and restarted: in `make test-all` (CI), not in `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REQUEST_TIMEOUT_S = 12.0
SKEW_S = 8.0  # the workers' deadline falls REQUEST_TIMEOUT_S - SKEW_S = 4 s after receipt
LONG = 1500  # new tokens: far more than 4 s of decoding on a CPU


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    skew = ["--test-clock-skew", str(SKEW_S)]
    c = start_roles(
        tmp_path_factory.mktemp("deadline"),
        [("prefill", {}, [*WORKER_FLAGS, *skew]), ("decode", {}, [*WORKER_FLAGS, *skew])],
        gateway_flags=[*GATEWAY_FLAGS, "--request-timeout", str(REQUEST_TIMEOUT_S)],
    )
    try:
        c.wait_healthy(workers=2)
        yield c
    finally:
        c.stop()


def test_requests_past_their_deadline_end_on_the_workers(cluster):
    c = cluster
    idle = pool_sizes(c.url)
    long_prompt = " ".join([PROMPT] * 60)  # several prefill chunks: some requests expire queued
    calls = [
        lambda: generate(c.url, body(LONG), 60),
        lambda: stream(c.url, body(LONG, stream=True), 60),
        lambda: generate(c.url, body(LONG, text=long_prompt), 60),
        lambda: stream(c.url, body(LONG, stream=True, text=long_prompt), 60),
    ] * 2
    with ThreadPoolExecutor(len(calls)) as pool:
        outs = list(pool.map(lambda f: f(), calls))
    spans = sorted(round(o.seconds, 1) for o in outs)
    print(
        f"deadline {REQUEST_TIMEOUT_S - SKEW_S:g} s after receipt: {len(outs)} requests ended after {spans} s"
    )
    for o in outs:
        assert not o.ok, "a request outlived its deadline"
        assert o.status in (504, 200), o  # plain: 504; streamed: an abort chunk and an error event
        assert f"timed out after {REQUEST_TIMEOUT_S:g} s" in o.error, o.error
        # Well before the gateway's own timer: a worker ended it.
        assert o.seconds < REQUEST_TIMEOUT_S - 2, spans
    wait_pools(c.url, idle)  # both legs freed their pages
    # Deadlines do not fire early: a short request still completes.
    out = generate(c.url, body(8))
    assert out.ok, out.error
