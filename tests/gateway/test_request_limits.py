"""One request's limits at the gateway: body size (413), unreadable JSON (400, never a 500), generations
per request, and tokenization off the event loop (a huge prompt does not stall other requests)."""

from __future__ import annotations

import threading
import time


def test_body_over_the_limit_is_a_413_before_it_is_read(wire_cluster):
    c = wire_cluster(max_request_bytes=4096)
    r = c.client.post("/generate", content=b'{"text": "' + b"a" * 8192 + b'"}')
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    assert (
        c.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code
        == 200
    )


def test_deep_json_and_huge_integers_are_400s(cluster):
    deep = b"[" * 100_000 + b"]" * 100_000
    r = cluster.client.post("/generate", content=b'{"text": "hi", "x": ' + deep + b"}")
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = cluster.client.post("/generate", content=b'{"input_ids": [' + b"9" * 5000 + b"]}")
    assert r.status_code == 400, r.text
    assert (
        cluster.client.post(
            "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        ).status_code
        == 200
    )


def test_generations_per_request_are_bounded(wire_cluster):
    c = wire_cluster(max_generations_per_request=8)
    body = {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 1, "n": 3}}
    r = c.client.post("/generate", json=body)
    assert r.status_code == 400 and "9 generations" in r.json()["error"]["message"]
    body["sampling_params"]["n"] = 2
    assert c.client.post("/generate", json=body).status_code == 200


def test_a_huge_prompt_does_not_stall_the_event_loop(cluster):
    """Tokenizing ~4M characters takes seconds; meanwhile /health keeps answering at once."""
    text = "word " * 800_000
    done = threading.Event()

    def big() -> None:
        cluster.client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        done.set()

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)  # the big body is being tokenized
    slowest = 0.0
    while not done.is_set():
        t0 = time.perf_counter()
        assert cluster.client.get("/health").status_code in (200, 503)
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    assert slowest < 0.5, f"/health took {slowest:.2f} s while a huge prompt was tokenized"
