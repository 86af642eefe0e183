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


def test_stop_strings_are_bounded(cluster):
    r = cluster.client.post("/generate", json={"text": "hi", "sampling_params": {"stop": ["x" * 1025]}})
    assert r.status_code == 400 and "1024 characters" in r.json()["error"]["message"]
    r = cluster.client.post("/v1/completions", json={"prompt": "hi", "stop": ["x"] * 17})
    assert r.status_code == 400, r.text


def test_a_prompt_that_cannot_fit_the_context_is_refused_before_tokenizing(cluster):
    """The wire workers' context is 2,048 tokens; no token of this tokenizer stands for more than
    `max_token_chars` characters, so a longer text is a 400 at once."""
    limit = 2048 * cluster.tokenizer.max_token_chars
    for path, body in [
        ("/generate", {"text": "a" * (limit + 1)}),
        ("/v1/completions", {"prompt": "a" * (limit + 1)}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (limit + 1)}]}),
    ]:
        t0 = time.perf_counter()
        r = cluster.client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert "characters" in r.json()["error"]["message"], r.text
        assert time.perf_counter() - t0 < 2.0
    # Just under the bound it is tokenized, and refused on its token count as before.
    r = cluster.client.post("/generate", json={"text": "a" * 10_000})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_admission_counts_generations(wire_cluster):
    c = wire_cluster(max_pending_generations=4)
    c.decode.step_s = 0.05
    r = c.client.post("/generate", json={"text": ["a"] * 5, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "at most 4 at once" in r.json()["error"]["message"]
    held = threading.Thread(
        target=lambda: c.client.post(
            "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 30, "n": 3}}
        )
    )
    held.start()
    time.sleep(0.3)  # 3 of the 4 generations are in flight
    r = c.client.post("/generate", json={"text": "b", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert r.status_code == 503 and "pending generations" in r.json()["error"]["message"]
    assert (
        c.client.post("/generate", json={"text": "b", "sampling_params": {"max_new_tokens": 2}}).status_code
        == 200
    )
    held.join(20)


def test_one_client_cannot_take_every_slot(wire_cluster):
    c = wire_cluster(max_requests_per_client=2, api_key="user-key", admin_api_key="admin-key")
    key = {"Authorization": "Bearer user-key"}
    c.decode.step_s = 0.05
    body = {"text": "a", "sampling_params": {"max_new_tokens": 30}}
    held = [
        threading.Thread(target=lambda: c.client.post("/generate", json=body, headers=key)) for _ in range(2)
    ]
    for t in held:
        t.start()
    time.sleep(0.3)
    r = c.client.post("/generate", json=body, headers=key)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    # Another client (another key) is let in; a wrong key is refused before it counts.
    other = c.client.post("/generate", json=body, headers={"Authorization": "Bearer admin-key"})
    assert other.status_code == 200
    assert c.client.post("/generate", json=body, headers={"Authorization": "Bearer x"}).status_code == 401
    for t in held:
        t.join(20)
    assert c.client.post("/generate", json=body, headers=key).status_code == 200
