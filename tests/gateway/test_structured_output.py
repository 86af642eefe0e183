"""Structured output at the gateway: response_format and the native constraints reach the workers as
one SamplingParams constraint; invalid schemas, regexes and grammars are 400s naming the problem."""

from __future__ import annotations

import json

import pytest

from .conftest import gateway_client

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _400(resp, needle: str, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"], err["message"]


@pytest.mark.parametrize(
    "path,body,needle,param",
    [
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                },
            },
            'Unsupported type "nope"',
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "must be a JSON object",
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "yaml"}},
            "yaml",
            "response_format.type",
        ),
        ("/v1/chat/completions", {**CHAT, "regex": "(ab"}, "parenthesis is not closed", "regex"),
        (
            "/v1/chat/completions",
            {**CHAT, "regex": "a+", "response_format": {"type": "json_object"}},
            "cannot be combined with regex",
            "response_format",
        ),
        ("/v1/completions", {"prompt": "a", "ebnf": "root ::= x"}, 'Rule "x" is not defined', "ebnf"),
        (
            "/generate",
            {"text": "a", "sampling_params": {"json_schema": "{bad"}},
            "not valid JSON",
            "sampling_params.json_schema",
        ),
        (
            "/generate",
            {"text": "a", "sampling_params": {"regex": "[a-"}},
            "invalid regex",
            "sampling_params.regex",
        ),
        (
            "/generate",
            {"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "at most one of json_schema, regex and ebnf",
            "sampling_params",
        ),
    ],
)
def test_invalid_constraints_are_400(client, path, body, needle, param):
    _400(client.post(path, json=body), needle, param)


def test_grammar_backend_none_refuses_constraints(tokenizer):
    with gateway_client(tokenizer, grammar_backend="none") as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_object"}})
        _400(r, "--grammar-backend none", "response_format")
        # Plain requests pass validation (503: no workers here).
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 503


@pytest.mark.parametrize(
    "path,body,kind,text",
    [
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                },
            },
            "json_schema",
            json.dumps(SCHEMA),
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_object"}},
            "json_schema",
            '{"type": "object"}',
        ),
        (
            "/v1/completions",
            {"prompt": "a", "response_format": {"type": "json_object"}},
            "json_schema",
            '{"type": "object"}',
        ),
        ("/v1/completions", {"prompt": "a", "regex": "[0-9]+"}, "regex", "[0-9]+"),
        ("/generate", {"text": "a", "sampling_params": {"ebnf": 'root ::= "a"'}}, "ebnf", 'root ::= "a"'),
        (
            "/generate",
            {"text": "a", "sampling_params": {"json_schema": json.dumps(SCHEMA)}},
            "json_schema",
            json.dumps(SCHEMA),
        ),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}, None, None),
    ],
)
def test_constraint_reaches_both_workers(cluster, path, body, kind, text):
    r = cluster.client.post(path, json=body)
    assert r.status_code == 200, r.text
    for w in (cluster.prefill, cluster.decode):
        sp = w.requests()[-1].sampling
        assert sp.constraint == ((kind, text) if kind else None)
