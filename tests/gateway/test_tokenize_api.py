"""/tokenize, /detokenize and /tokenizer_info: vLLM's and SGLang's shapes, the exact calls of
lm-evaluation-harness's remote tokenizer, and the gateway's own tokenizer's answers."""

from __future__ import annotations

from pdserve.gateway.tokenizer import Tokenizer


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
