"""/workers tells a lost worker from a live one: a killed worker is listed as `down` (with `?all=1`)
until the launcher has restarted it, then `healthy` again with one restart counted."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from harness import start_up
from reliability.calls import body, generate, wait_for

# Minutes of real clusters killed and restarted: in `make test-all` (CI), not in `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Longer than the gateway's default heartbeat timeout (5 s), so the worker is seen down before the
# launcher starts it again.
BACKOFF_S = 8.0


def listing(url: str, everything: bool = False) -> dict[str, dict]:
    r = httpx.get(url + "/workers", params={"all": 1} if everything else None, timeout=10)
    return {w["worker_id"]: w for w in r.json()["workers"]}


def test_killed_worker_is_listed_down_then_healthy_with_a_restart(tmp_path):
    c = start_up(tmp_path, extra=["--restart-backoff", str(BACKOFF_S)])
    try:
        c.wait_healthy(workers=2)
        before = listing(c.url, everything=True)
        assert {w: (x["state"], x["restarts"]) for w, x in before.items()} == {
            "prefill-0": ("healthy", 0),
            "decode-0": ("healthy", 0),
        }
        first_registered = before["decode-0"]["registered_at"]
        assert abs(time.time() - first_registered) < 600

        pid = int(re.findall(r"started decode-0 pid (\d+)", (tmp_path / "up.log").read_text())[-1])
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: listing(c.url, True)["decode-0"]["state"] == "down", 30, "decode-0 listed down")
        down_s = time.monotonic() - t0
        assert "decode-0" not in listing(c.url), "the default listing holds live workers only"
        assert httpx.get(c.url + "/health", timeout=5).status_code == 503  # no decode to route to

        wait_for(lambda: "decode-0" in listing(c.url), 180, "decode-0 registered again")
        back_s = time.monotonic() - t0
        again = listing(c.url, everything=True)
        assert again["decode-0"]["state"] == "healthy" and again["decode-0"]["restarts"] == 1, again
        assert again["decode-0"]["registered_at"] > first_registered
        assert again["prefill-0"]["restarts"] == 0
        out = generate(c.url, body(8))
        assert out.ok, out.error
        print(f"decode-0 listed down {down_s:.1f} s after kill -9, healthy again after {back_s:.1f} s")
    finally:
        c.stop()
