"""Bodies as real clients send them: null as the default, unknown keys ignored (one warning), fields
SGLang and OpenAI clients send on every request, and the few that must still be refused, by name.

Every request here used to be a 400; each goes through the gateway to workers speaking the real wire
protocol, and where the field matters, the test checks what reached the workers.
"""

from __future__ import annotations

import logging

import pytest

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

pytestmark = pytest.mark.timeout(60)


def _ok(resp) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json() if resp.headers["content-type"].startswith("application/json") else {}


def _refused(resp, status: int, param: str, *needles: str, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    for n in needles:
        assert n in err["message"], err["message"]
    return err


@pytest.mark.parametrize(
    "path,body",
    [
        # bench_serving --backend sglang, every request
        (
            "/generate",
            {
                "text": "Hello",
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": False},
                "stream": False,
                "lora_path": None,
                "return_logprob": False,
                "logprob_start_len": -1,
            },
        ),
        # bench_serving --backend sglang-oai
        (
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "Hello",
                "temperature": 0.0,
                "best_of": 1,
                "max_tokens": 4,
                "stream": False,
                "ignore_eos": False,
            },
        ),
        # bench_serving --backend sglang-oai-chat
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hello"}],
                "temperature": 0.0,
                "max_completion_tokens": 4,
                "stream": False,
                "ignore_eos": False,
            },
        ),
        # null means the default
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "n": None,
                "stream": None,
                "logprobs": None,
                "top_logprobs": None,
                "ignore_eos": None,
                "skip_special_tokens": None,
                "temperature": None,
                "stop": None,
                "seed": None,
                "user": None,
                "tools": None,
                "tool_choice": None,
                "response_format": None,
                "stream_options": None,
                "parallel_tool_calls": None,
                "model": None,
            },
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": None, "echo": None, "logprobs": None}),
        (
            "/generate",
            {
                "text": "hi",
                "stream": None,
                "rid": None,
                "return_logprob": None,
                "sampling_params": {
                    "max_new_tokens": 2,
                    "n": None,
                    "ignore_eos": None,
                    "skip_special_tokens": None,
                },
            },
        ),
        # chat fields of reasoning models and OpenAI's storage
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "chat_template_kwargs": {"enable_thinking": False},
                "reasoning_effort": "low",
                "store": False,
                "metadata": {"team": "a"},
                "separate_reasoning": True,
                "stream_reasoning": False,
            },
        ),
        # tools, every tool_choice, and the tool-call history
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": "required",
                "parallel_tool_calls": False,
            },
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "refusal": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ],
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "max_tokens": 4,
            },
        ),
        # unknown keys, at the top and inside
        ("/v1/chat/completions", {**CHAT, "frobnicate": 3, "extra_body": {"x": 1}}),
        (
            "/generate",
            {
                "text": "hi",
                "sampling_params": {
                    "max_new_tokens": 2,
                    "spaces_between_special_tokens": False,
                    "unknown_knob": 1,
                },
                "custom_field": "x",
            },
        ),
    ],
)
def test_previously_refused_bodies_are_served(cluster, path, body):
    _ok(cluster.client.post(path, json=body))


def test_unknown_keys_are_logged_once_by_name(cluster, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.gateway.protocol"):
        _ok(cluster.client.post("/generate", json={"text": "hi", "foo": 1, "sampling_params": {"bar": 2}}))
    lines = [r.getMessage() for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert lines == ["ignoring unknown request fields: foo, sampling_params.bar"]


def test_sampling_fields_reach_the_workers(cluster, tokenizer):
    body = {
        "text": "hi",
        "sampling_params": {
            "max_new_tokens": 8,
            "sampling_seed": 11,
            "min_new_tokens": 3,
            "logit_bias": {"42": 5.0, "7": -100},
            "no_stop_trim": True,
            "stop": ["Paris"],
        },
    }
    _ok(cluster.client.post("/generate", json=body))
    sp = cluster.prefill.requests()[-1].sampling
    assert sp.seed == 11 and sp.min_new_tokens == 3 and sp.logit_bias == {42: 5.0, 7: -100.0}
    assert sp.no_stop_trim
    # OpenAI's logit_bias and seed
    _ok(cluster.client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"5": 1.5}, "seed": 3}))
    sp = cluster.prefill.requests()[-1].sampling
    assert sp.logit_bias == {5: 1.5} and sp.seed == 3


def test_no_stop_trim_keeps_the_stop_string(cluster):
    cluster.reply = "The capital of France is Paris, of course."
    body = {"text": "q", "sampling_params": {"max_new_tokens": 32, "stop": ["Paris"]}}
    assert cluster.client.post("/generate", json=body).json()["text"] == "The capital of France is "
    body["sampling_params"]["no_stop_trim"] = True
    assert cluster.client.post("/generate", json=body).json()["text"] == "The capital of France is Paris"


def test_multi_part_text_is_joined_like_sglang(cluster, tokenizer):
    parts = [{"type": "text", "text": "Capital of"}, {"type": "text", "text": "France?"}]
    _ok(cluster.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]}))
    want = tokenizer.encode_chat([{"role": "user", "content": "Capital of France?"}])
    assert cluster.prefill.requests()[-1].input_ids == want


@pytest.mark.parametrize(
    "body,param,needle",
    [
        ({"text": "hi", "lora_path": "my-adapter"}, "lora_path", "LoRA"),
        ({"text": "hi", "image_data": ["http://x/cat.png"]}, "image_data", "vision"),
        ({"text": "hi", "return_hidden_states": True}, "return_hidden_states", "hidden states"),
        (
            {"text": "hi", "sampling_params": {"structural_tag": "{}"}},
            "sampling_params.structural_tag",
            "structural",
        ),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_by_name(cluster, body, param, needle):
    _refused(cluster.client.post("/generate", json=body), 400, param, needle, code="unsupported_parameter")


def test_image_part_is_refused(cluster):
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
    ]
    r = cluster.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    _refused(r, 400, "messages.0.content", "no vision input")


@pytest.mark.parametrize(
    "body,param,needle",
    [
        ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
        ({**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
        ({**CHAT, "min_new_tokens": 10, "max_tokens": 4}, "min_new_tokens", "more than max_new_tokens"),
        ({**CHAT, "tool_choice": "required"}, None, "needs tools"),
        (
            {
                **CHAT,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            None,
            "not in tools",
        ),
        ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ],
)
def test_bad_values_are_400(cluster, body, param, needle):
    r = cluster.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and (param is None or err["param"] == param), err


def test_model_names(cluster):
    models = _ok(cluster.client.get("/v1/models"))
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert _ok(cluster.client.get(f"/v1/models/{MODEL}"))["id"] == MODEL
    _refused(cluster.client.get("/v1/models/gpt-4"), 404, "model", "gpt-4", code="model_not_found")
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
        _refused(
            cluster.client.post(path, json={**body, "model": "default"}), 404, "model", code="model_not_found"
        )
        out = _ok(cluster.client.post(path, json={**body, "model": MODEL, "max_tokens": 2}))
        assert out["model"] == MODEL


def test_served_model_name_flag(wire_cluster):
    c = wire_cluster(served_model_name="smol")
    assert [m["id"] for m in c.client.get("/v1/models").json()["data"]] == ["smol"]
    _ok(c.client.post("/v1/chat/completions", json={**CHAT, "model": "smol"}))
    assert c.client.post("/v1/chat/completions", json={**CHAT, "model": MODEL}).status_code == 404
