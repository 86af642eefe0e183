"""`pdserve up --elastic` on 3 workers of the bundled model: traffic that turns prompt-heavy moves the split
from 1P2D to 2P1D, and back when it turns answer-heavy, with no request lost; every decision is shown on
/dashboard/data and counted."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from harness import start_up
from reliability.calls import body, generate, workers

# Serial: it drives a cluster hard for a minute, which would skew (and be skewed by) a parallel neighbour.
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(600)]

ELASTIC = [
    "--elastic",
    "--elastic-interval", "0.5",
    "--elastic-confirm", "2",
    "--elastic-cooldown", "2",
    "--elastic-window", "15",
    "--elastic-ttft-slo", "1.5",
    "--elastic-tpot-slo", "10",
    "--max-running-requests", "4",
]  # fmt: skip
LONG = "Describe the history of the printing press, the telegraph and the radio in detail. " * 20


def _split(url: str) -> tuple[int, int]:
    ws = [w for w in workers(url).values() if w["state"] == "healthy"]
    return sum(w["role"] == "prefill" for w in ws), sum(w["role"] == "decode" for w in ws)


def _drive(url: str, req: dict, until, timeout_s: float, streams: int = 8) -> list:
    """`streams` clients sending `req` back to back until `until()` holds (checked every 0.5 s)."""
    stop = threading.Event()
    outs: list = []

    def client() -> None:
        while not stop.is_set():
            outs.append(generate(url, req, timeout=180))

    threads = [threading.Thread(target=client) for _ in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not until():
            assert time.monotonic() < deadline, f"the split stayed {_split(url)}"
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return outs


def test_the_split_follows_the_traffic(tmp_path):
    c = start_up(tmp_path, num_prefill=1, num_decode=2, extra=ELASTIC)
    try:
        c.wait_healthy(workers=3)
        prompt_heavy = body(2, text=LONG)
        answer_heavy = body(48, text="Count from one to fifty in words.")
        outs = _drive(c.url, prompt_heavy, lambda: _split(c.url) == (2, 1), 240)
        outs += _drive(c.url, answer_heavy, lambda: _split(c.url) == (1, 2), 300)
        assert outs and all(o.ok for o in outs), [o.error for o in outs if not o.ok][:3]

        data = httpx.get(c.url + "/dashboard/data", timeout=10).json()["elastic"]
        moves = [
            (d["from_role"], d["to_role"]) for d in reversed(data["decisions"]) if d["outcome"] == "switching"
        ]
        assert moves[:2] == [("decode", "prefill"), ("prefill", "decode")], data["decisions"]
        assert "prefill pressure" in data["decisions"][-1]["reason"]
        metrics = httpx.get(c.url + "/metrics", timeout=10).text
        for a, b in (("decode", "prefill"), ("prefill", "decode")):
            # at least the two moves above (the controller may have moved again since)
            found = re.search(
                rf'pdserve_role_switches_total{{from_role="{a}",to_role="{b}"}} ([0-9.]+)', metrics
            )
            assert found and float(found.group(1)) >= 1.0, (a, b)
    finally:
        c.stop()
