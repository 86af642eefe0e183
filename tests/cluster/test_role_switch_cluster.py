"""Role switching of real worker processes (`pdserve up`, 2 prefill + 1 decode, the bundled model): a
prefill worker becomes a decode worker under load without losing a request or reloading its weights,
and a worker killed mid-switch comes back in its launch role while the rest keep serving."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_up
from reliability.calls import body, generate, wait_for, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROMPTS = [f"Write a short note about the number {i} and why it matters." for i in range(8)]
# Long enough that each prefill worker still has prompts queued or in a forward when the switch comes.
LONG = [
    p + " Consider its history, its uses in science and art, and its place in daily life." * 24
    for p in PROMPTS
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_up(tmp_path_factory.mktemp("roles"), num_prefill=2, num_decode=1)
    try:
        c.wait_healthy(workers=3)
        c.reference = {p: generate(c.url, body(12, text=p)).output_ids for p in PROMPTS[:2]}
        yield c
    finally:
        c.stop()


def _switch(url: str, worker_id: str, role: str) -> httpx.Response:
    return httpx.post(f"{url}/workers/{worker_id}/role", json={"role": role}, timeout=10)


def _log(c, name: str) -> str:
    with open(os.path.join(c.log_dir, f"{name}.log")) as f:
        return f.read()


def _pids(c, name: str) -> list[int]:
    with open(os.path.join(c.log_dir, "up.log")) as f:
        return [int(pid) for n, pid in re.findall(r"started (\S+) pid (\d+)", f.read()) if n == name]


def _decode_workers_used(url: str) -> set[str]:
    data = httpx.get(url + "/dashboard/data", timeout=10).json()
    return {r["decode_worker"] for r in data["requests"]}


def test_a_prefill_worker_becomes_a_decode_worker_under_load(cluster):
    c = cluster
    pid = _pids(c, "prefill-1")[-1]
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(generate, c.url, body(24, text=p)) for p in LONG]
        time.sleep(0.5)  # requests are in flight on every worker
        r = _switch(c.url, "prefill-1", "decode")
        assert r.status_code == 202, r.text
        assert r.json()["to"] == "decode" and r.json()["epoch"] == 1
        outs = [f.result() for f in calls]
    assert all(o.ok and len(o.output_ids) == 24 for o in outs), [o.error for o in outs if not o.ok]

    wait_for(
        lambda: (
            workers(c.url).get("prefill-1", {}).get("role") == "decode"
            and workers(c.url)["prefill-1"]["state"] == "healthy"
        ),
        60,
        "prefill-1 registered as a decode worker",
    )
    w = workers(c.url)["prefill-1"]
    assert w["epoch"] == 1 and w["restarts"] == 0
    assert _pids(c, "prefill-1") == [pid], "the switch must not restart the process"
    log = _log(c, "prefill-1")
    assert "role switch: prefill -> decode (epoch 1) on the same weights" in log
    held = [int(n) for n in re.findall(r"draining: (\d+) requests left", log)]
    assert held and held[0] >= 1, "the switch came when prefill-1 held no request: not a switch under load"
    assert log.count("KV pool:") == 1, "the runner (weights and pool) was built again"

    # The last prefill worker cannot leave its role.
    last = _switch(c.url, "prefill-0", "decode")
    assert last.status_code == 409 and "last prefill worker" in last.json()["error"]["message"]

    # The cluster now decodes on both; the switched worker's tokens are the model's.
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: generate(c.url, body(12, text=p)), PROMPTS[:2] * 4))
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    assert "prefill-1" in _decode_workers_used(c.url)
    for o, p in zip(outs[:2], PROMPTS[:2]):
        assert o.output_ids == c.reference[p]
    metrics = httpx.get(c.url + "/metrics", timeout=10).text
    assert 'pdserve_role_switches_total{from_role="prefill",to_role="decode"} 1.0' in metrics


def test_a_worker_killed_mid_switch_comes_back_in_its_launch_role(cluster):
    c = cluster
    if workers(c.url).get("prefill-1", {}).get("role") != "decode":
        pytest.skip("needs the switch of the test before")
    with ThreadPoolExecutor(6) as pool:
        calls = [pool.submit(generate, c.url, body(64, text=p)) for p in PROMPTS[:6]]
        time.sleep(1.5)
        assert _switch(c.url, "prefill-1", "prefill").status_code == 202
        time.sleep(0.3)  # draining its decode requests
        os.kill(_pids(c, "prefill-1")[-1], signal.SIGKILL)
        outs = [f.result() for f in calls]
    # Every call ended: served, or a clear error for a request the dead worker held.
    assert all(o.ok or o.error for o in outs)
    assert sum(o.ok for o in outs) >= 1
    wait_for(lambda: len(_pids(c, "prefill-1")) == 2, 60, "the launcher to restart prefill-1")
    wait_for(
        lambda: workers(c.url).get("prefill-1", {}).get("state") == "healthy",
        120,
        "prefill-1 back in rotation",
    )
    w = workers(c.url)["prefill-1"]
    assert (w["role"], w["epoch"], w["switch"]) == ("prefill", 0, None)
    out = generate(c.url, body(12, text=PROMPTS[0]))
    assert out.ok and out.output_ids == c.reference[PROMPTS[0]]
