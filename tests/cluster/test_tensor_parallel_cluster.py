"""Tensor-parallel workers in a real cluster: `pdserve up --prefill-tp 3` and `--decode-tp 3` (the
bundled model's 3 KV heads split over 3 ranks, each rank a process in the worker's gloo group) serve
transformers' greedy tokens, with the KV handed between a TP-3 and a TP-1 worker in both directions and
between two TP-3 workers (each decode rank's head copied from the prefill rank holding it),
through NGRAM speculation, a cached prefix and a grammar; one rank killed mid-stream takes its
worker down as one unit, its streams move to the other decode worker, and the unit comes back whole.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_up, started_pids
from reliability.calls import body, generate, metric, wait_for, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [list(range(300, 340)), [1, 504, 3458, 282, 4649, 314, 2657, 30]]
N = 12


def _generate_ids(url: str, ids: list[int], n: int, **params) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **params}
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=240)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(
    scope="module", params=[(3, 1), (1, 3), (3, 3)], ids=["prefill-tp3", "decode-tp3-ngram", "both-tp3-ngram"]
)
def tp_cluster(request, tmp_path_factory):
    prefill_tp, decode_tp = request.param
    extra = ["--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)]
    if decode_tp > 1:
        extra += ["--speculative-algorithm", "NGRAM"]
    c = start_up(tmp_path_factory.mktemp(f"tp{prefill_tp}{decode_tp}"), extra=extra)
    try:
        c.wait_healthy(workers=2)
        c.tp = {"prefill-0": prefill_tp, "decode-0": decode_tp}
        yield c
    finally:
        c.stop()


def test_greedy_tokens_equal_transformers_across_tp_layouts(tp_cluster, engine_reference) -> None:
    _, theirs = engine_reference(PROMPTS, N)
    for ids, want in zip(PROMPTS, theirs):
        out = _generate_ids(tp_cluster.url, ids, N)
        assert out["output_ids"] == want
    listed = workers(tp_cluster.url)
    assert {wid: w["tp_size"] for wid, w in listed.items()} == tp_cluster.tp


def test_a_cached_prefix_and_a_grammar_on_tp_workers(tp_cluster, engine_reference) -> None:
    prompt = list(range(500, 580))  # 5 whole pages
    _, (want,) = engine_reference([prompt], N)
    first = _generate_ids(tp_cluster.url, prompt, N)
    again = _generate_ids(tp_cluster.url, prompt, N)
    assert first["output_ids"] == again["output_ids"] == want
    assert again["meta_info"]["cached_tokens"] >= 64
    r = httpx.post(
        tp_cluster.url + "/generate",
        json={
            "text": "My phone number is",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": r"[0-9]{3}-[0-9]{4}"},
        },
        timeout=240,
    )
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.json()["text"]), r.json()["text"]


def _follower_pids(worker_pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(worker_pid)], capture_output=True, text=True
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "pdserve.runtime.tp_follower" in line]


def test_a_killed_rank_takes_its_worker_down_and_its_streams_move(tmp_path) -> None:
    """Two decode workers of TP 3; a stream on each. kill -9 rank 2 of the one holding a stream: its
    rank 0 leaves, the stream moves to the other worker and ends with the uninterrupted tokens, and
    `pdserve up` restarts the worker with three ranks again."""
    c = start_up(tmp_path, num_decode=2, extra=["--decode-tp", "3", "--decode-policy", "round_robin"])
    try:
        c.wait_healthy(workers=3)
        n = 40
        ref = generate(c.url, body(n))
        assert ref.ok
        started = threading.Barrier(3)

        def streamed() -> list[int]:
            ids: list[int] = []
            req = body(n, stream=True)
            with httpx.stream("POST", c.url + "/generate", json=req, timeout=240) as r:
                assert r.status_code == 200
                seen = False
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ids = json.loads(line[6:])["output_ids"]
                        if not seen and len(ids) >= 2:
                            seen = True
                            started.wait(120)
            return ids

        moved_before = metric(c.url, "pdserve_request_migrations_total")
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(streamed) for _ in range(2)]
            started.wait(180)
            pid = started_pids(c.log_dir)["decode-0"][-1]
            ranks = _follower_pids(pid)
            assert len(ranks) == 2, ranks
            os.kill(ranks[-1], signal.SIGKILL)
            outs = [f.result(timeout=300) for f in futures]
        assert outs == [ref.output_ids, ref.output_ids]
        assert metric(c.url, "pdserve_request_migrations_total") - moved_before == 1
        wait_for(lambda: len(started_pids(c.log_dir)["decode-0"]) >= 2, 120, "decode-0 restarted")
        c.wait_healthy(workers=3)
        new = started_pids(c.log_dir)["decode-0"][-1]
        wait_for(lambda: len(_follower_pids(new)) == 2, 120, "the restarted decode-0's two ranks")
        o = generate(c.url, body(16))
        assert o.ok and o.output_ids == ref.output_ids[:16]
    finally:
        c.stop()
