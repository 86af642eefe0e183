"""The decode worker's prefix cache end to end (real processes, the bundled model, fp32):

- incremental transfer: a conversation's next turn, routed back to the decode worker that holds its
  history, moves only the pages after that history (the byte count says so), and decodes the same
  greedy tokens as an engine without any cache;
- conditional disaggregation: a prompt whose uncached part is under
  `--disaggregation-min-prefill-tokens` never reaches a prefill worker; the decode worker computes it,
  the counter and the stitched timeline say so, and the tokens are the same.
"""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest
from harness import start_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = 16  # the workers' default page size
PAGE_BYTES = 30 * 2 * PAGE * 3 * 64 * 4  # layers x (K, V) x tokens x KV heads x head dim x fp32
THRESHOLD = 48


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


@pytest.fixture(scope="module", params=["plain", "ngram"])
def cluster(request, tmp_path_factory):
    extra = ["--dtype", "float32", "--disaggregation-min-prefill-tokens", str(THRESHOLD)]
    if request.param == "ngram":
        extra += ["--speculative-algorithm", "NGRAM"]
    c = start_up(tmp_path_factory.mktemp(f"inc-{request.param}"), extra=extra)
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(pdserve_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _routed_to_prefill(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith('pdserve_routed_requests_total{role="prefill"'))


def _generate(url: str, ids: list[int], n: int) -> tuple[dict, dict[str, float]]:
    """One greedy request; its response and what it added to the gateway's counters."""
    before = _metrics(url)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    time.sleep(0.3)  # the decode worker's KVEvents follow its reply
    after = _metrics(url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    return r.json(), delta


def test_next_turn_moves_only_the_new_pages_and_decodes_the_same_tokens(cluster, engine_reference):
    p1 = _ids(1, 200)
    t1, d1 = _generate(cluster.url, p1, 16)
    pages1 = -(-len(p1) // PAGE)
    trailer = d1["pdserve_kv_transfer_bytes_total"] - pages1 * PAGE_BYTES
    assert 0 <= trailer < 4096, d1  # a full transfer: every page of the prompt (and any trailer)
    assert d1["pdserve_transfer_skipped_tokens_total"] == 0

    # Turn 2: the history plus 60 new tokens (more than the threshold: a prefill worker computes them).
    history = p1 + t1["output_ids"]
    p2 = history + _ids(2, 60)
    t2, d2 = _generate(cluster.url, p2, 16)
    held = (len(history) - 1) // PAGE  # every token but the newest has KV on the decode worker
    moved = -(-len(p2) // PAGE) - held
    assert d2["pdserve_transfer_skipped_tokens_total"] == held * PAGE, d2
    assert d2["pdserve_kv_transfer_bytes_total"] == moved * PAGE_BYTES + trailer, (d2, moved)
    assert d2["pdserve_local_prefill_requests_total"] == 0
    assert t2["meta_info"]["cached_tokens"] >= len(p1) // PAGE * PAGE  # the prefill worker's own cache

    # Turn 1's prompt again: the decode worker holds all its whole pages, and the 8 tokens left are
    # under the threshold, so it computes them itself and nothing travels.
    t3, d3 = _generate(cluster.url, p1, 16)
    assert d3["pdserve_kv_transfer_bytes_total"] == 0 and d3["pdserve_local_prefill_requests_total"] == 1, d3
    assert t3["meta_info"]["cached_tokens"] == (len(p1) - 1) // PAGE * PAGE

    (want1, want2), _ = engine_reference([p1, p2], 16)
    assert t1["output_ids"] == want1 and t2["output_ids"] == want2 and t3["output_ids"] == want1


def test_short_uncached_prompt_never_reaches_a_prefill_worker(cluster, engine_reference):
    short = _ids(3, THRESHOLD - 8)
    t, d = _generate(cluster.url, short, 12)
    assert d["pdserve_local_prefill_requests_total"] == 1, d
    assert _routed_to_prefill(d) == 0, d
    assert d["pdserve_kv_transfer_bytes_total"] == 0
    meta = t["meta_info"]
    # The stitched timeline holds the decode worker's prefill events, in order.
    received = meta["request_received_ts"]
    assert received <= meta["forward_entry_time"] <= meta["prefill_finished_time"]
    assert meta["prefill_finished_time"] <= received + meta["first_token_latency"] + 1e-3
    assert meta["cached_tokens"] == 0

    # Its next turn adds a few tokens to a history the decode worker holds: computed there as well,
    # on top of the cached pages, which `cached_tokens` now reports.
    history = short + t["output_ids"]
    t2, d2 = _generate(cluster.url, history + _ids(4, 10), 12)
    assert d2["pdserve_local_prefill_requests_total"] == 1 and _routed_to_prefill(d2) == 0, d2
    assert t2["meta_info"]["cached_tokens"] == (len(history) - 1) // PAGE * PAGE

    # A long uncached prompt still goes through a prefill worker.
    long = _ids(5, 3 * THRESHOLD)
    t3, d3 = _generate(cluster.url, long, 12)
    assert d3["pdserve_local_prefill_requests_total"] == 0 and _routed_to_prefill(d3) == 1, d3

    (w1, w2, w3), _ = engine_reference([short, history + _ids(4, 10), long], 12)
    assert (t["output_ids"], t2["output_ids"], t3["output_ids"]) == (w1, w2, w3)
