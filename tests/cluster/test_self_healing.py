"""`pdserve up` outlives its parts: a killed gateway or worker is restarted by the launcher and the
cluster serves again, with the processes that were not killed left alone."""

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

# Minutes of real clusters killed and restarted: in `make test-all` (CI), not in `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_up(tmp_path_factory.mktemp("healing"), num_decode=2)
    try:
        c.wait_healthy(workers=3)
        c.reference = generate(c.url, body(16)).output_ids
        yield c
    finally:
        c.stop()


def started(c) -> dict[str, list[int]]:
    """Every start the launcher reported: name -> pids, oldest first."""
    out: dict[str, list[int]] = {}
    with open(os.path.join(c.log_dir, "up.log")) as f:
        for name, pid in re.findall(r"started (\S+) pid (\d+)", f.read()):
            out.setdefault(name, []).append(int(pid))
    return out


def registrations(c, worker_id: str) -> int:
    with open(os.path.join(c.log_dir, f"{worker_id}.log")) as f:
        return f.read().count(f"worker {worker_id} registered")


def kill_and_wait_back(c, name: str) -> float:
    """kill -9 worker `name`; seconds until the launcher restarted it and the new process registered."""
    before = started(c)
    regs = registrations(c, name)
    t0 = time.monotonic()
    os.kill(before[name][-1], signal.SIGKILL)
    wait_for(lambda: len(started(c)[name]) == len(before[name]) + 1, 30, f"{name} restarted")
    wait_for(lambda: registrations(c, name) == regs + 1, 120, f"the new {name} to register")
    wait_for(lambda: len(workers(c.url)) == 3, 30, "three workers listed")
    return time.monotonic() - t0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_killed_gateway_comes_back_on_its_port_with_the_same_workers(cluster):
    c = cluster
    before = started(c)
    t0 = time.monotonic()
    os.kill(before["gateway"][-1], signal.SIGKILL)
    wait_for(lambda: not _healthy(c.url), 10, "the gateway to go away")
    # Same URL: the restarted gateway binds the ports the first one got; the workers find it.
    wait_for(lambda: _healthy(c.url) and len(workers(c.url)) == 3, 60, "the gateway and its workers")
    back_s = time.monotonic() - t0
    after = started(c)
    assert len(after["gateway"]) == len(before["gateway"]) + 1
    assert {n: p for n, p in after.items() if n != "gateway"} == {
        n: p for n, p in before.items() if n != "gateway"
    }, "a worker was restarted although only the gateway died"
    out = generate(c.url, body(16))
    assert out.ok and out.output_ids == c.reference, out.error
    print(f"gateway serving again {back_s:.1f} s after kill -9")


def test_killed_decode_worker_is_restarted_and_serves(cluster):
    c = cluster
    before = started(c)
    back_s = kill_and_wait_back(c, "decode-0")
    assert started(c)["decode-1"] == before["decode-1"] and started(c)["prefill-0"] == before["prefill-0"]
    # Both decode workers take requests again (least-outstanding routing spreads a burst of 6).
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda _: generate(c.url, body(16)), range(6)))
    assert all(o.ok and o.output_ids == c.reference for o in outs), [o.error for o in outs]
    print(f"decode-0 registered again {back_s:.1f} s after kill -9")


def test_killed_prefill_worker_is_restarted_and_serves(cluster):
    c = cluster
    before = started(c)
    back_s = kill_and_wait_back(c, "prefill-0")
    assert {n: p for n, p in started(c).items() if n != "prefill-0"} == {
        n: p for n, p in before.items() if n != "prefill-0"
    }, "another process was restarted although only prefill-0 died"
    # The only prefill worker serves again: every request goes through the restarted one.
    out = generate(c.url, body(16))
    assert out.ok and out.output_ids == c.reference, out.error
    print(f"prefill-0 registered again {back_s:.1f} s after kill -9")


def test_gap_without_a_prefill_worker_answers_503_then_serving_resumes(tmp_path):
    """The only prefill worker of a 1+1 cluster dies: while it is away (a 10 s restart backoff makes
    the gap certain) requests get a clear 503 with Retry-After; then serving resumes on its own."""
    c = start_up(tmp_path, extra=["--restart-backoff", "10"])
    try:
        c.wait_healthy(workers=2)
        reference = generate(c.url, body(8)).output_ids
        os.kill(started(c)["prefill-0"][-1], signal.SIGKILL)
        wait_for(lambda: not _healthy(c.url), 30, "the gateway to notice the lost prefill worker")
        r = httpx.post(c.url + "/generate", json=body(8), timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "no prefill worker in rotation" in r.json()["error"]["message"]
        wait_for(lambda: _healthy(c.url), 120, "the restarted prefill worker")
        out = generate(c.url, body(8))
        assert out.ok and out.output_ids == reference, out.error
    finally:
        c.stop()
