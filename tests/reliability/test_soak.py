"""A bounded soak on loopback: many short requests at high concurrency, mixed streaming, random
client disconnects. Zero lost requests; pools and the gateway's pending count back to idle.

PDSERVE_SOAK_REQUESTS overrides the request count (default 2,000 at concurrency 64).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time

import httpx
import psutil
import pytest
from harness import start_roles
from reliability.calls import GATEWAY_FLAGS, WORKER_FLAGS, metric, pool_sizes, wait_pools

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(600)]

REQUESTS = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "2000"))
CONCURRENCY = 64
DISCONNECT_P = 0.1
TOPICS = ["rivers", "bridges", "clocks", "maps", "bees", "glass", "tea", "salt"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_roles(
        tmp_path_factory.mktemp("soak"),
        [("prefill", {}, WORKER_FLAGS), ("decode", {}, WORKER_FLAGS)],
        gateway_flags=GATEWAY_FLAGS,
    )
    try:
        c.wait_healthy(workers=2)
        yield c
    finally:
        c.stop()


class _PeakRss:
    """Samples the resident memory of the cluster's processes (gateway and each worker)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.peak = {k: 0 for k in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, p in self.procs.items():
                try:
                    self.peak[k] = max(self.peak[k], sum(c.memory_info().rss for c in [p, *p.children(True)]))
                except psutil.Error:
                    pass
            self._stop.wait(0.5)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int) -> tuple[str, float]:
    """('ok' | 'error:<status>:<message head>' | 'disconnected' | 'lost:<why>', seconds)."""
    streaming = rng.random() < 0.5
    leave = rng.random() < DISCONNECT_P
    n = rng.randint(2, 4)
    req = {
        "text": f"Request {i}: a short note about {rng.choice(TOPICS)}",
        "stream": streaming,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    t0 = time.monotonic()
    try:
        if streaming:
            async with client.stream("POST", "/generate", json=req) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"error:{r.status_code}:{r.json()['error']['message'][:40]}", time.monotonic() - t0
                last, done = None, False
                async for line in r.aiter_lines():
                    if leave:
                        return "disconnected", time.monotonic() - t0
                    if line == "data: [DONE]":
                        done = True
                        break
                    if line.startswith("data: "):
                        last = json.loads(line[6:])
                if not done or last is None:
                    return "lost:stream cut", time.monotonic() - t0
                if "error" in last:
                    return f"error:stream:{last['error']['message'][:40]}", time.monotonic() - t0
                ok = last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == n
                return ("ok" if ok else f"lost:bad finish {last['meta_info']}"), time.monotonic() - t0
        if leave:
            try:
                await asyncio.wait_for(client.post("/generate", json=req), rng.uniform(0.01, 0.3))
            except TimeoutError:
                return "disconnected", time.monotonic() - t0
            return "ok", time.monotonic() - t0  # finished before the client left
        r = await client.post("/generate", json=req)
        if r.status_code != 200:
            return f"error:{r.status_code}:{r.json()['error']['message'][:40]}", time.monotonic() - t0
        out = r.json()
        ok = out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == n
        return ("ok" if ok else f"lost:bad finish {out['meta_info']}"), time.monotonic() - t0
    except httpx.HTTPError as e:
        return f"lost:{type(e).__name__}", time.monotonic() - t0


async def _soak(url: str) -> list[tuple[str, float]]:
    rng = random.Random(8)
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def run(i: int) -> tuple[str, float]:
            async with sem:
                return await _one(client, rng, i)

        return await asyncio.gather(*(run(i) for i in range(REQUESTS)))


def test_soak_loses_no_request(cluster, record_property):
    c = cluster
    idle = pool_sizes(c.url)
    pids = {"gateway": c.procs[0].pid, "prefill": c.procs[1].pid, "decode": c.procs[2].pid}
    t0 = time.monotonic()
    with _PeakRss(pids) as rss:
        results = asyncio.run(_soak(c.url))
    wall = time.monotonic() - t0
    kinds: dict[str, int] = {}
    for kind, _ in results:
        kinds[kind] = kinds.get(kind, 0) + 1
    lat = sorted(dt for k, dt in results if k == "ok")
    p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    retries = metric(c.url, "pdserve_request_retries_total")
    summary = {
        "requests": REQUESTS,
        "concurrency": CONCURRENCY,
        "wall_s": round(wall, 1),
        "outcomes": kinds,
        "retries": retries,
        "p50_s": round(p50, 3),
        "p99_s": round(p99, 3),
        "peak_rss_mib": {k: round(v / 2**20) for k, v in rss.peak.items()},
    }
    print("soak:", json.dumps(summary))
    record_property("soak", summary)
    assert len(results) == REQUESTS
    assert not [k for k in kinds if k.startswith("lost")], kinds
    assert not [k for k in kinds if k.startswith("error")], kinds  # no faults injected: no errors
    assert kinds.get("ok", 0) > REQUESTS * 0.8
    wait_pools(c.url, idle)
    deadline = time.monotonic() + 10
    while metric(c.url, "pdserve_pending_requests") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(c.url, "pdserve_pending_requests") == 0
