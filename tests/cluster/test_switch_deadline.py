"""A role switch drains with a deadline (--switch-drain-timeout): past it, the requests the switching
worker still holds are failed with code `draining`, which the gateway runs on elsewhere (a mid-stream
migration, docs/reliability.md), so that a long generation neither holds the switch up nor fails.

Real processes: the gateway, one prefill and two decode workers, the bundled model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_roles
from reliability.calls import WORKER_FLAGS, body, generate, wait_for, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEADLINE_S = 2.0
# Far longer to generate than the deadline on a CPU worker: without the deadline, the switch waits.
LONG_TOKENS = 1500
DECODES = ("decode-1", "decode-2")


def _running_on(url: str) -> str | None:
    ws = workers(url)
    return next((wid for wid in DECODES if ws.get(wid, {}).get("running", 0) > 0), None)


def test_a_long_request_moves_on_when_the_switch_deadline_passes(tmp_path):
    flags = [*WORKER_FLAGS, "--switch-drain-timeout", str(DEADLINE_S)]
    nodes: list = [("prefill", {}, flags), ("decode", {}, flags), ("decode", {}, flags)]
    c = start_roles(tmp_path, nodes)
    try:
        c.wait_healthy(workers=3)
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(generate, c.url, body(LONG_TOKENS), 400)
            wait_for(lambda: _running_on(c.url) is not None, 60, "a decode worker running the request")
            holder = _running_on(c.url)
            assert holder is not None
            r = httpx.post(f"{c.url}/workers/{holder}/role", json={"role": "prefill"}, timeout=10)
            assert r.status_code == 202, r.text
            begun = time.monotonic()
            wait_for(
                lambda: (
                    workers(c.url)[holder]["role"] == "prefill"
                    and workers(c.url)[holder]["state"] == "healthy"
                ),
                120,
                f"{holder} registered as a prefill worker",
            )
            switched = time.monotonic()
            out = call.result()
        # The switch did not wait for the request: it was done while the request went on elsewhere.
        assert switched < out.ended, (switched - begun, out.seconds)
        assert switched - begun < 60, switched - begun
        assert out.ok and len(out.output_ids) == LONG_TOKENS, out.error
        assert out.meta is not None and out.meta.get("num_migrations") == 1, out.meta
        other = next(wid for wid in DECODES if wid != holder)
        assert workers(c.url)[other]["role"] == "decode"
        with open(f"{c.log_dir}/{holder}.log") as f:
            log = f.read()
        assert "handing off 1 requests" in log, log[-2000:]
    finally:
        c.stop()
