"""Every error on Anthropic's Messages paths has Anthropic's shape, whoever raised it (the key check,
the body and per-client limits, the request's checks, an unknown route, no worker to serve it), and
the anthropic client turns each into its exception class; the gateway as its own process, no workers.
Other paths keep OpenAI's shape."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from harness import start_gateway, stop_processes

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-anthropic-5e1d"
USER = {"role": "user", "content": "Hi"}
TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Iterator[str]:
    flags = [
        "--served-model-name",
        "smol",
        "--api-key",
        KEY,
        "--max-request-bytes",
        "65536",
        "--max-requests-per-client",
        "1",
    ]
    proc, port, _ = start_gateway(
        str(tmp_path_factory.mktemp("anthropic-errors")),
        [*flags, "--log-level", "warning"],
        env={"TOKENIZERS_PARALLELISM": "false"},
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_processes([proc], grace_s=10)


def _client(base: str, key: str = KEY):
    import anthropic

    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=30)


def _error_of(exc_info: pytest.ExceptionInfo, kind: str) -> str:
    body = exc_info.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_key_size_and_rate_limits_in_anthropic_shape(base):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(base, "wrong").messages.create(model="smol", max_tokens=4, messages=[USER])
    assert "x-api-key" in _error_of(e, "authentication_error")
    with pytest.raises(anthropic.APIStatusError) as e:  # 413: the body is over --max-request-bytes
        _client(base).messages.create(
            model="smol", max_tokens=4, messages=[{"role": "user", "content": "x" * 70000}]
        )
    assert e.value.status_code == 413
    _error_of(e, "request_too_large")
    # This key's one request slot held by a body that never finishes: the next one is a 429.
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as held:
        held.sendall(
            f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
            "content-type: application/json\r\ncontent-length: 100\r\n\r\n{".encode()
        )
        for _ in range(50):  # until the gateway has taken the held request's headers (else a 503)
            try:
                _client(base).messages.create(model="smol", max_tokens=4, messages=[USER])
            except anthropic.RateLimitError as exc:
                limited = exc
                break
            except anthropic.APIStatusError:
                time.sleep(0.1)
        else:
            raise AssertionError("no 429 while the key's one slot was held")
        body = limited.body
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    # The same refusals elsewhere keep OpenAI's shape.
    r = httpx.post(f"{base}/v1/chat/completions", headers={"x-api-key": "wrong"}, json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_no_worker_unknown_route_and_method_in_anthropic_shape(base):
    import anthropic

    with pytest.raises(anthropic.APIStatusError) as e:  # a valid request, no worker to serve it
        _client(base).messages.create(model="smol", max_tokens=4, messages=[USER])
    assert e.value.status_code == 503
    _error_of(e, "overloaded_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        _client(base).messages.create(model="other", max_tokens=4, messages=[USER])
    assert "other" in _error_of(e, "not_found_error")
    h = {"x-api-key": KEY}
    r = httpx.post(f"{base}/v1/messages/batches", headers=h, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    r = httpx.get(f"{base}/v1/messages", headers=h)
    assert r.status_code == 405 and r.json()["type"] == "error", r.text


@pytest.mark.parametrize(
    ("why", "kw"),
    [
        ("thinking.budget_tokens", {"thinking": {"type": "enabled", "budget_tokens": -5}}),
        ("thinking.budget_tokens", {"thinking": {"type": "enabled", "budget_tokens": 2000}}),  # >= max_tokens
        ("messages.0.role", {"messages": [{"role": "assistant", "content": "Hello"}, USER]}),
        ("tools.1.name", {"tools": [TOOL, TOOL]}),
        (
            "messages.1.content.0.id",  # a tool_use without an id
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "name": "get_weather", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}],
                    },
                ]
            },
        ),
        (
            "messages.1.content.0.tool_use_id",  # a tool_result answering no tool_use
            {"messages": [USER, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}]},
        ),
    ],
)
def test_what_anthropic_refuses_is_a_bad_request(base, why, kw):
    import anthropic

    args = {"model": "smol", "max_tokens": 1500, "messages": [USER], **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        _client(base).messages.create(**args)
    assert _error_of(e, "invalid_request_error").startswith(why)
