"""A heavy grammar compiling does not stall other requests (issue #35, row 4): through `pdserve up`,
a stream keeps getting tokens while an EBNF that takes seconds to compile is compiled by the gateway,
the prefill and the decode worker. Before, each worker compiled on its scheduler thread, and the
stream's tokens stopped for the decode's whole compile."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from harness import start_up

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

HEAVY = 6000  # character classes in a row: about 3 s to compile on one idle core here


def chain(n: int, tag: str) -> str:
    classes = " ".join(f"[a-{chr(98 + i % 24)}]" for i in range(n))
    return f'root ::= "{tag}" {classes}\n'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_up(tmp_path_factory.mktemp("grammar-stall"), extra=["--grammar-compile-timeout", "120"])
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


def test_a_heavy_compile_does_not_stall_a_stream(cluster):
    # Every process builds its grammar backend first (once), so only the compile is measured.
    warm = {"text": "yes or no?", "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 2}}
    assert httpx.post(cluster.url + "/generate", json=warm, timeout=300).status_code == 200
    stamps: list[float] = []
    heavy: dict[str, float | int] = {}
    done = threading.Event()

    def compile_heavy() -> None:
        body = {"text": "a", "sampling_params": {"ebnf": chain(HEAVY, "stall"), "max_new_tokens": 2}}
        heavy["start"] = time.monotonic()
        r = httpx.post(cluster.url + "/generate", json=body, timeout=300)
        heavy["end"], heavy["status"] = time.monotonic(), r.status_code
        done.set()

    body = {
        "text": "Count from one to a thousand:",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
    }
    with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.monotonic())
            if len(stamps) == 10:
                threading.Thread(target=compile_heavy, daemon=True).start()
            if done.is_set() and stamps[-1] > heavy["end"] + 0.5:
                break
            assert json.loads(line[6:])["meta_info"]["finish_reason"] is None, "the stream ended first"
    assert heavy["status"] == 200
    took = heavy["end"] - heavy["start"]
    assert took > 2.0, f"the heavy grammar's request took {took:.2f} s: too light to show a stall"
    during = [t for t in stamps if heavy["start"] <= t <= heavy["end"]]
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    longest = max(gaps)
    before = [b - a for a, b in zip(stamps, stamps[1:10], strict=False)]
    print(f"heavy request {took:.1f} s; {len(during)} stream chunks meanwhile, longest gap {longest:.2f} s")
    print(f"gaps before it: {[round(g, 2) for g in before]}")
    assert len(during) > 10
    # On a loaded 2-core machine a decode step takes tens of ms; a compile on the decode's loop
    # stopped the stream for the whole compile (seconds).
    assert longest < 1.5, f"the stream stopped for {longest:.2f} s while the grammar compiled"
