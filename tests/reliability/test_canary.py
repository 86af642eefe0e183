"""Canaries (gateway/autopilot/canary.py) with real processes and the bundled model: a decode worker that starts
to answer wrong (a test hook: from its second request on, every token it decodes reaches the gateway as
the next id) leaves rotation within one canary round, and the others keep serving."""

from __future__ import annotations

import time

import pytest
from harness import start_roles
from reliability.calls import GATEWAY_FLAGS, WORKER_FLAGS, body, generate, metric, wait_for, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

INTERVAL_S = 2.0


def test_a_decode_worker_that_answers_wrong_leaves_rotation_and_the_others_serve(tmp_path):
    c = start_roles(
        tmp_path,
        [
            ("prefill", {}, WORKER_FLAGS),
            ("decode", {}, [*WORKER_FLAGS, "--test-wrong-tokens-from", "2"]),
            ("decode", {}, WORKER_FLAGS),
        ],
        gateway_flags=[*GATEWAY_FLAGS, "--canary-interval", str(INTERVAL_S)],
    )
    try:
        c.wait_healthy(workers=3)
        # The first round gives each pair its reference (decode-1's first request is still right).
        wait_for(lambda: metric(c.url, "pdserve_canaries_total") >= 2, 60, "both pairs' references")
        referenced = time.monotonic()
        wait_for(lambda: workers(c.url)["decode-1"]["state"] == "suspect", 60, "decode-1 suspect")
        took = time.monotonic() - referenced
        print(f"decode-1 suspect {took:.1f} s after the references (interval {INTERVAL_S:g} s)")
        states = {wid: w["state"] for wid, w in workers(c.url).items()}
        assert states == {"prefill-0": "healthy", "decode-1": "suspect", "decode-2": "healthy"}, states
        assert workers(c.url)["decode-1"]["suspect"].startswith(
            "canary mismatch on prefill-0 -> decode-1: token"
        )
        assert metric(c.url, "pdserve_canary_mismatches_total") >= 1
        # Canaries never count in the user's metrics.
        assert metric(c.url, "pdserve_prompt_tokens_total") == 0
        with open(f"{c.log_dir}/gateway.log") as f:
            log = f.read()
        assert "canary: pair prefill-0 -> decode-1 answered" in log and "decode-1 is suspect" in log, log
        # The others keep serving, right answers only: decode-2 agrees with the canaries' references.
        outs = [generate(c.url, body(8), 120) for _ in range(3)]
        assert all(o.ok for o in outs) and len({tuple(o.output_ids) for o in outs}) == 1, outs
        time.sleep(2 * INTERVAL_S)  # more rounds: decode-2 stays in rotation
        assert workers(c.url)["decode-2"]["state"] == "healthy"
    finally:
        c.stop()
