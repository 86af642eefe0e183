"""Bad input -> HTTP 400 with an OpenAI-style body naming the problem; no workers -> 503."""

from __future__ import annotations

import pytest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _assert_400(resp, *needles: str, param: str | None = None) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] is None or isinstance(err["code"], str)
    for n in needles:
        assert n in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_malformed_json(client, path):
    r = client.post(path, content=b'{"text": "hi",', headers={"content-type": "application/json"})
    _assert_400(r, "malformed JSON")


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_not_an_object(client, path):
    _assert_400(client.post(path, json=[1, 2]), "JSON object")


@pytest.mark.parametrize(
    "path,body,needle,param",
    [
        ("/generate", {}, "exactly one of", None),
        ("/generate", {"text": "a", "input_ids": [1]}, "exactly one of", None),
        ("/generate", {"text": 5}, "text", None),
        ("/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature", None),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens", None),
        ("/generate", {"text": "a", "stream": "yes"}, "stream", "stream"),
        ("/v1/chat/completions", {}, "messages", "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages", "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role", None),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, "max_tokens", "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "requires logprobs", None),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream", None),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "n"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "function", "tools.0.function"),
        ("/v1/completions", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": "a", "logprobs": 50}, "logprobs", "logprobs"),
        ("/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_tokens", "max_tokens"),
    ],
)
def test_schema_errors(client, path, body, needle, param):
    _assert_400(client.post(path, json=body), needle, param=param)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", 1000.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("presence_penalty", -2.5),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", -1),
    ],
)
def test_out_of_range_sampling(client, field, value):
    r = client.post("/generate", json={"text": "a", "sampling_params": {field: value}})
    err = _assert_400(r)
    assert field in (err["param"] or "") + err["message"]
    r = client.post("/v1/chat/completions", json={**CHAT, field: value})
    err = _assert_400(r)
    assert field in (err["param"] or "") + err["message"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", {"text": ""}, "text"),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"text": []}, "text"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
    ],
)
def test_empty_prompt(client, path, body, param):
    _assert_400(client.post(path, json=body), "empty", param=param)


def test_token_ids_outside_vocabulary(client, tokenizer):
    v = tokenizer.vocab_size
    _assert_400(client.post("/generate", json={"input_ids": [1, v]}), "vocabulary", str(v), param="input_ids")
    _assert_400(client.post("/generate", json={"input_ids": [[1], [-3]]}), "vocabulary")
    _assert_400(client.post("/v1/completions", json={"prompt": [5, v + 10]}), "vocabulary", param="prompt")


@pytest.mark.parametrize(
    "path,body",
    [
        ("/generate", {"text": "The capital of France is"}),
        ("/generate", {"input_ids": [1, 2, 3], "stream": True}),
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "hello", "stream": True}),
    ],
)
def test_valid_request_without_workers_is_503(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "prefill" in err["message"] and "decode" in err["message"]
    assert r.headers["retry-after"]


def test_health_and_models_without_workers(client):
    r = client.get("/health")
    assert r.status_code == 503
    assert "no prefill" in r.json()["error"]["message"]
    models = client.get("/v1/models").json()
    assert [d["id"] for d in models["data"]] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]


def test_unknown_route_and_method(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.get("/generate")
    assert r.status_code == 405 and "error" in r.json()


def test_server_stays_healthy_after_garbage(client):
    # Not UTF-8, not JSON: each is refused as bad input, not a server error.
    for garbage in (b"\xff\xfe garbage", b"\x00\x01\x02", b"{]"):
        for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
            r = client.post(path, content=garbage, headers={"content-type": "application/json"})
            _assert_400(r, "malformed JSON")
    assert client.get("/v1/models").status_code == 200


def test_metrics_endpoint(client):
    client.post("/generate", json={"text": "x"})  # rejected: no workers
    body = client.get("/metrics").text
    assert 'pdserve_rejected_requests_total{reason="no_workers"} 1.0' in body
    assert "pdserve_time_to_first_token_seconds_bucket" in body
