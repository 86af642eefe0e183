"""Cache-aware routing end to end: 2 prefill + 2 decode workers (real processes, the bundled model),
prompts that share long prefixes, and the `cached_tokens` each response reports (the prefill
workers' hits) and the prompt tokens whose KV did not travel (the decode workers' hits).

8 distinct prefixes of 8 pages, each sent 3 times in interleaved rounds (each round in a rotated
order, so that round-robin routing puts a prefix's second send on the other worker). The ideal hit
rate is 2/3 of the prompt tokens (the first send of each prefix computes it). Requests go one at a
time with a short pause, so each finished request's KVEvents reach the gateway before the next.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_roles, start_up
from reliability.calls import metric

# Minutes of real clusters killed and restarted: in `make test-all` (CI), not in `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = 16  # the workers' default page size
NUM_PREFIXES, PREFIX_PAGES, ROUNDS = 8, 8, 3
PREFIXES = [
    [random.Random(k).randrange(1000, 20000) for _ in range(PREFIX_PAGES * PAGE)] for k in range(NUM_PREFIXES)
]


def _prompt(k: int, rnd: int) -> list[int]:
    return PREFIXES[k] + [30 + rnd, 40 + k]  # a shared prefix, then a short suffix of its own


def _order() -> list[tuple[int, int]]:
    """(prefix, round) in send order: round r sends the prefixes rotated by r."""
    return [((j + r) % NUM_PREFIXES, r) for r in range(ROUNDS) for j in range(NUM_PREFIXES)]


def _generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == len(ids)
    return meta


def _hit_rate(url: str, sends: list[tuple[int, int]]) -> float:
    cached = prompt = 0
    for k, rnd in sends:
        meta = _generate(url, _prompt(k, rnd))
        cached += meta["cached_tokens"]
        prompt += meta["prompt_tokens"]
        time.sleep(0.3)  # the prefill's KVEvents follow its transfer's end
    return cached / prompt


def _cached_blocks(url: str) -> int:
    ws = httpx.get(url + "/workers", timeout=5).json()["workers"]
    return sum(w["cached_blocks"] for w in ws if w["role"] == "prefill")


def _wait_blocks(url: str, expect: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := _cached_blocks(url)) != expect and time.monotonic() < deadline:
        time.sleep(0.2)
    assert n == expect, f"the gateway's index holds {n} blocks, {expect} expected"


def test_cache_aware_routing_serves_most_prompt_tokens_from_cache(tmp_path):
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        workers: list = [("prefill", {}), ("prefill", {}), ("decode", {}), ("decode", {})]
        (tmp_path / policy).mkdir()
        flags = ["--prefill-policy", policy, "--decode-policy", policy]
        c = start_roles(tmp_path / policy, workers, gateway_flags=flags)
        try:
            c.wait_healthy(workers=4)
            rates[policy] = _hit_rate(c.url, _order())
            rates[f"{policy} decode"] = metric(c.url, "pdserve_transfer_skipped_tokens_total") / metric(
                c.url, "pdserve_prompt_tokens_total"
            )
        finally:
            c.stop()
    print(f"prompt tokens served from cache: {rates}, ideal {2 / 3:.3f}")
    assert rates["cache_aware"] >= 0.6, rates
    assert rates["round_robin"] <= rates["cache_aware"] - 0.15, rates
    # The decode workers' caches: a prefix sent back to the decode worker that holds it skips its pages.
    assert rates["cache_aware decode"] >= 0.5, rates
    assert rates["round_robin decode"] <= rates["cache_aware decode"] - 0.15, rates


def test_index_survives_a_gateway_restart_and_flush_cache_empties_it(tmp_path):
    c = start_up(tmp_path, num_prefill=2, num_decode=1)
    try:
        c.wait_healthy(workers=3)
        _hit_rate(c.url, _order()[: 2 * NUM_PREFIXES])  # two rounds: every prefix cached once
        _wait_blocks(c.url, NUM_PREFIXES * PREFIX_PAGES, 10)
        pid = int(re.findall(r"started gateway pid (\d+)", (tmp_path / "up.log").read_text())[0])
        os.kill(pid, signal.SIGKILL)
        # The launcher restarts the gateway; the workers re-register and send their snapshots.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if _cached_blocks(c.url) == NUM_PREFIXES * PREFIX_PAGES:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        c.wait_healthy(workers=3)
        _wait_blocks(c.url, NUM_PREFIXES * PREFIX_PAGES, 5)
        after = _hit_rate(c.url, _order()[2 * NUM_PREFIXES :])
        ideal = PREFIX_PAGES * PAGE / len(_prompt(0, 0))
        print(f"hit rate after the gateway restart: {after:.3f} (ideal {ideal:.3f})")
        assert after >= 0.9 * ideal

        for method in ("POST", "GET"):
            r = httpx.request(method, c.url + "/flush_cache", timeout=30)
            assert r.status_code == 200, r.text
            _wait_blocks(c.url, 0, 5)  # the workers published the removal
            meta = _generate(c.url, _prompt(0, 0))
            assert meta["cached_tokens"] == 0
            time.sleep(0.3)
    finally:
        c.stop()


def test_flush_cache_is_refused_while_a_prefill_holds_a_request(tmp_path):
    """A prefill worker holding a request (its KV send stalled by the test hook) refuses to flush, and
    the gateway's answer names it; once the request is done the flush goes through."""
    workers: list = [("prefill", {}, ["--test-stall-kv-send", "4"]), ("decode", {})]
    c = start_roles(tmp_path, workers)
    try:
        c.wait_healthy(workers=2)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_generate, c.url, _prompt(0, 0))
            time.sleep(2)  # prefilled and held by the stall
            r = httpx.post(c.url + "/flush_cache", timeout=30)
            assert r.status_code == 400, r.text
            assert "prefill-0" in r.json()["error"]["message"], r.text
            pending.result(timeout=120)
        time.sleep(0.3)
        assert httpx.post(c.url + "/flush_cache", timeout=30).status_code == 200
        _wait_blocks(c.url, 0, 5)
    finally:
        c.stop()
