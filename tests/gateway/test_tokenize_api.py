"""/tokenize, /detokenize and /tokenizer_info: vLLM's and SGLang's shapes, the exact calls of
lm-evaluation-harness's remote tokenizer, and the gateway's own tokenizer's answers."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from pdserve.gateway.text.tokenizer import Tokenizer


def test_tokenize_round_trip_is_the_gateways_tokenizer(client, tokenizer: Tokenizer):
    text = "The capital of France is Paris."
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tokenizer.hf.encode(text, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and "max_model_len" in out
    # SGLang's field name, and token strings on request.
    r = client.post("/tokenize", json={"text": text, "return_token_strs": True})
    assert r.json()["tokens"] == out["tokens"]
    assert "".join(r.json()["token_strs"]) == text
    back = client.post("/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == text == back["text"]


def test_tokenize_chat_messages_as_the_chat_template_renders_them(client, tokenizer: Tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode_chat(msgs)
    r = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})
    text = tokenizer.hf.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert r.json()["tokens"] == tokenizer.encode_rendered(text)


def test_lm_eval_remote_tokenizer_calls(client, tokenizer: Tokenizer):
    """What lm-eval's RemoteTokenizer (tokenizer_backend=remote) asks, field by field."""
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.hf.eos_token and "bos_token" in info and "pad_token" in info
    assert info["chat_template"] == tokenizer.hf.chat_template
    eos = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] == tokenizer.eos_token_id
    ids = client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "test"


def test_tokenize_bad_input_is_a_400(client):
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, {"prompt": 3}):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = client.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
    assert client.post("/detokenize", content=b"{").status_code == 400


# ---- limits: /generate's caps, the client's slots ------------------------------------------------------


def test_tokenize_and_detokenize_have_generations_length_caps(cluster, tokenizer: Tokenizer):
    """/generate's cap on a prompt (the wire workers' 2,048-token context x the longest token's
    characters) holds for every form of /tokenize; as many tokens at most come out of it or go into
    /detokenize. Each refusal is a 400 naming the field."""
    limit = 2048 * tokenizer.max_token_chars
    over = "a" * (limit + 1)
    for body, param in [
        ({"prompt": over}, "prompt"),
        ({"text": over, "return_token_strs": True}, "text"),
        ({"messages": [{"role": "user", "content": over}]}, "messages"),
        # Within the characters, two tokens each: past the tokens.
        ({"prompt": "\U0001f642" * (limit // 2 + 1)}, "prompt"),
    ]:
        r = cluster.client.post("/tokenize", json=body)
        assert r.status_code == 400, (param, r.text[:200])
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    r = cluster.client.post("/detokenize", json={"tokens": [0] * (limit + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text[:200]
    # The bounds themselves are served, and round-trip.
    r = cluster.client.post(
        "/tokenize", json={"prompt": "\U0001f642" * (limit // 2), "return_token_strs": True}
    )
    assert r.status_code == 200 and r.json()["count"] == limit == len(r.json()["token_strs"])
    assert r.json()["max_model_len"] == 2048
    back = cluster.client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert back.status_code == 200 and back.json()["text"] == "\U0001f642" * (limit // 2)


def test_tokenize_without_workers_is_capped_too(client, tokenizer: Tokenizer):
    """No worker in rotation tells the context length: the bundled model's is assumed."""
    r = client.post("/tokenize", json={"prompt": "a" * (8192 * tokenizer.max_token_chars + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:200]


def _stalled(base: str, path: str, key: str) -> socket.socket:
    """A request whose headers are in and whose body never comes: it holds its client's slot."""
    u = urlsplit(base)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
    s.sendall(head.encode() + b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": ')
    return s


@pytest.mark.timeout(120)
def test_tokenizer_routes_count_against_the_clients_limit(limited_gateway):
    """/tokenize and /detokenize each hold one of their client's slots from their headers on: past
    the limit, a 429 with OpenAI's body; another client (another key) is let in meanwhile."""
    base, key = limited_gateway, {"Authorization": "Bearer user-key"}
    held = [_stalled(base, "/tokenize", "user-key"), _stalled(base, "/detokenize", "user-key")]
    time.sleep(0.5)  # both in, waiting for their bodies
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(base + path, json=body, headers=key, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", (path, r.text)
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    other = httpx.post(
        base + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer admin-key"}
    )
    assert other.status_code == 200
    for s in held:  # gone mid-body: their slots are given back
        s.close()
    deadline = time.monotonic() + 10
    while httpx.post(base + "/tokenize", json={"prompt": "hi"}, headers=key).status_code == 429:
        assert time.monotonic() < deadline, "the slots of the requests that left were never given back"
        time.sleep(0.1)
