"""A decode pool far too small, bursts far above the gateway's bound, and clients that walk away.

One cluster: the decode pool holds 256 tokens (16 pages), the gateway admits 6 requests at a time.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from harness import start_roles
from reliability.calls import (
    GATEWAY_FLAGS,
    WORKER_FLAGS,
    Outcome,
    body,
    generate,
    metric,
    pool_sizes,
    stream,
    wait_pools,
)

pytestmark = pytest.mark.timeout(400)

MAX_PENDING = 6
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three primary colors:",
    "The best way to learn a language is",
    "Water boils at",
]


# A prefilled request waits for the decode's page list while the tiny decode pool is full: on two
# shared cores that can outlast the usual 20 s, and it is a wait, not a failure.
PRESSURE_FLAGS = [*WORKER_FLAGS, "--waiting-timeout", "120"]
# The host's default dtype and quantization, batch-invariant: a retracted request resumed by
# recomputation gives what it gives alone (runtime/determinism.py).
DETERMINISTIC = ["--dtype", "auto", "--quantization", "auto", "--deterministic", "on"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_roles(
        tmp_path_factory.mktemp("pressure"),
        [
            ("prefill", {}, [*PRESSURE_FLAGS, *DETERMINISTIC]),
            ("decode", {}, [*PRESSURE_FLAGS, *DETERMINISTIC, "--max-total-tokens", "256"]),
        ],
        gateway_flags=[*GATEWAY_FLAGS, "--max-pending-generations", str(MAX_PENDING)],
    )
    try:
        c.wait_healthy(workers=2)
        c.idle = pool_sizes(c.url)
        yield c
    finally:
        c.stop()


def _ids(texts: list[str]) -> list[list[int]]:
    from pdserve.gateway.text.tokenizer import Tokenizer

    tok = Tokenizer.load(None)
    return [tok.encode(t) for t in texts]


def _offline(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy ids from the offline engine with a pool that never retracts, in the cluster's configuration."""
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine
    from pdserve.sampling_params import SamplingParams

    engine = Engine(RuntimeConfig(dtype="auto", deterministic="on", max_total_tokens=4096, num_threads=1))
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [o.output_ids for o in engine.generate(prompts, params)]


def test_tiny_decode_pool_retracts_and_resumes_with_exact_output(cluster):
    c = cluster
    ids = _ids(PROMPTS)
    n = 100

    def one(p: list[int]):
        req = {"input_ids": p, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        return generate(c.url, req, 300)

    with ThreadPoolExecutor(len(ids)) as pool:
        outs = list(pool.map(one, ids))
    assert all(o.ok for o in outs), [o.error for o in outs]
    retractions = [o.meta["num_retractions"] for o in outs]
    print("num_retractions:", retractions)
    assert sum(retractions) > 0
    assert all(o.meta.get("deterministic") is True for o in outs)
    assert [o.output_ids for o in outs] == _offline(ids, n)
    wait_pools(c.url, c.idle)


def test_burst_above_the_bound_gets_fast_503_and_memory_stays_bounded(cluster):
    c = cluster
    gateway = psutil.Process(c.procs[0].pid)
    reference = generate(c.url, body(6)).output_ids

    def burst() -> list:
        with ThreadPoolExecutor(40) as pool:
            return list(pool.map(lambda _: _timed_post(c.url, body(6)), range(40)))

    burst()  # warm up the gateway's allocations
    rss0 = gateway.memory_info().rss
    for _ in range(3):
        results = burst()
        refused = [r for r in results if r[0].status_code == 503]
        served = [r for r in results if r[0].status_code == 200]
        assert len(refused) + len(served) == len(results), [r[0].status_code for r in results]
        assert refused and served
        for r, dt in refused:
            assert r.headers.get("retry-after") == "1"
            assert "pending generations" in r.json()["error"]["message"]
            # Refused at once, not queued behind the generations (3.1 s was seen on two cores shared by
            # two test runs: the bound leaves room for a slow client thread, not for a queue).
            assert dt < 10.0, dt
        for r, _ in served:
            assert r.json()["output_ids"] == reference
    growth = gateway.memory_info().rss - rss0
    print(f"gateway RSS {rss0 / 2**20:.0f} MiB, growth over 3 bursts {growth / 2**20:.1f} MiB")
    assert growth < 32 * 2**20
    wait_pools(c.url, c.idle)


def _timed_post(url: str, req: dict) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", json=req, timeout=120)
    return r, time.monotonic() - t0


def test_fifty_client_disconnects_free_every_page(cluster):
    c = cluster
    rng = random.Random(0)
    plans = [(i % 3, rng.uniform(0.2, 1.5), rng.choice([0, 1, 3])) for i in range(50)]

    def leave(plan: tuple[int, float, int]) -> tuple[int, Outcome | None]:
        kind, patience, stop_after = plan
        if kind == 2:  # a plain request whose client gives up
            try:
                r = httpx.post(c.url + "/generate", json=body(100), timeout=patience)
            except httpx.TimeoutException:
                return 0, None
            # Served in full before the client gave up: rare, but not a failure.
            assert r.status_code == 200, r.text
            return 0, None
        # A stream left right after the headers, or after a few chunks.
        stop_after = stop_after if kind else 0
        return stop_after, stream(c.url, body(100, stream=True), 60, stop_after=stop_after)

    aborts_before = metric(c.url, "pdserve_aborted_legs_total")
    # Half the bound at once: a client that leaves frees its slot only once the gateway has seen it go
    # and aborted its legs, which may come after the same client thread has sent its next request. With
    # MAX_PENDING - 1 threads, two departures not yet seen made a (correct) 503 on a loaded machine.
    with ThreadPoolExecutor(MAX_PENDING // 2) as pool:
        results = list(pool.map(leave, plans))
    # Every stream was accepted (no 503 under the bound) and those left after chunks had them.
    started = 0
    for stop_after, o in results:
        if o is None:
            continue
        assert o.status == 499, (o.status, o.error)  # the client left; anything else is a refusal
        assert o.events >= stop_after, (stop_after, o.events)
        started += stop_after > 0
    assert started >= 5, started
    wait_pools(c.url, c.idle)
    deadline = time.monotonic() + 10
    while metric(c.url, "pdserve_pending_requests") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(c.url, "pdserve_pending_requests") == 0
    # Each stream left mid-generation aborted at least its decode leg, and the gateway counted it.
    aborted = metric(c.url, "pdserve_aborted_legs_total") - aborts_before
    assert aborted >= started, (aborted, started)
    assert generate(c.url, body(6)).ok  # and the cluster still serves
