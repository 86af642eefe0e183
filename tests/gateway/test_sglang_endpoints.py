"""SGLang's endpoints on the gateway: /health_generate, /get_server_info (/server_info), /get_model_info,
/abort_request, PUT /generate and per-prompt sampling_params in native batches."""

from __future__ import annotations

import threading
import time

import pytest

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(60)


def test_health_generate_runs_through_both_legs(cluster):
    before = len(cluster.prefill.requests()), len(cluster.decode.requests())
    r = cluster.client.get("/health_generate")
    assert r.status_code == 200, r.text
    assert (len(cluster.prefill.requests()), len(cluster.decode.requests())) == (before[0] + 1, before[1] + 1)
    assert cluster.decode.requests()[-1].sampling.max_new_tokens == 2


def test_health_generate_without_a_decode_worker_is_503(cluster):
    cluster.decode.stop()
    deadline = time.monotonic() + 10
    while cluster.client.get("/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = cluster.client.get("/health_generate")
    assert r.status_code == 503 and "decode" in r.json()["error"]["message"]


def test_server_and_model_info(cluster):
    info = cluster.client.get("/get_server_info").json()
    assert cluster.client.get("/server_info").json().keys() == info.keys()
    assert info["served_model_name"] == MODEL and info["context_length"] == 2048
    assert info["max_total_num_tokens"] == 4096
    assert {s["worker_id"] for s in info["internal_states"]} == {"p0", "d0"}
    assert "avg_spec_accept_length" in info["internal_states"][0]
    assert info["prefill_policy"] == "cache_aware"
    model = cluster.client.get("/get_model_info").json()
    assert model["model_path"] == MODEL and model["is_generation"] is True
    assert model["has_image_understanding"] is False and model["model_type"] == "llama"
    assert model["architectures"] == ["llama"]


def test_put_generate(cluster):
    r = cluster.client.put("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


def test_per_prompt_sampling_params(cluster):
    body = {
        "text": ["a", "b"],
        "sampling_params": [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 5, "n": 2}],
    }
    out = cluster.client.post("/generate", json=body).json()
    assert [len(o["output_ids"]) for o in out] == [2, 5, 5]
    got = sorted((r.sampling.max_new_tokens, r.sampling.temperature) for r in cluster.decode.requests())
    assert got == [(2, 0.0), (5, 1.0), (5, 1.0)]
    body["sampling_params"] = [{"max_new_tokens": 2}]
    r = cluster.client.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params"
    body["sampling_params"] = [{"max_new_tokens": 2}, {"temperature": -1}]
    r = cluster.client.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("sampling_params.1")


def test_abort_request(cluster):
    cluster.decode.step_s = 0.2  # a slow decode: the request is still running when the abort comes
    cluster.reply = "one two three four five six seven eight nine ten " * 3
    result: dict = {}

    def run() -> None:
        body = {"text": "count", "rid": "slow-1", "sampling_params": {"max_new_tokens": 40}}
        result["resp"] = cluster.client.post("/generate", json=body)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while not cluster.decode.requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert cluster.client.post("/abort_request", json={"rid": "nobody"}).json() == {"aborted": 0}
    assert cluster.client.post("/abort_request", json={"rid": "slow-1"}).json() == {"aborted": 1}
    t.join(10)
    resp = result["resp"]
    assert resp.status_code == 400 and "aborted by /abort_request" in resp.json()["error"]["message"]
    # Both legs were told (the decode leg's room is aborted).
    deadline = time.monotonic() + 5
    while not cluster.decode.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.decode.aborted == [cluster.decode.requests()[-1].room]
    r = cluster.client.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
