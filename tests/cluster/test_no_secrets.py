"""A `pdserve up` with an inference key and an admin key (from the environment, as an operator sets
them): no answer of any endpoint, with either key, and no log line holds either key's text."""

from __future__ import annotations

import glob
import os
import re
import secrets
from collections.abc import Iterator

import httpx
import pytest
from harness import start_up

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.server import create_app
from pdserve.gateway.text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)

INFERENCE_KEY = "inf-" + secrets.token_hex(12)
ADMIN_KEY = "adm-" + secrets.token_hex(12)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    env = {"PDSERVE_API_KEY": INFERENCE_KEY, "PDSERVE_ADMIN_API_KEY": ADMIN_KEY}
    c = start_up(tmp_path_factory.mktemp("keyed"), env=env)
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


def _routes(routes: list) -> Iterator:
    for r in routes:
        inner = getattr(r, "original_router", None)  # an included router (no prefix in the gateway)
        yield from _routes(inner.routes) if inner is not None else [r]


def _get_paths(model: str) -> list[str]:
    """Every GET path of the gateway's route table (the docs' and the dashboard's too), path
    parameters filled with the served model's name."""
    app = create_app(GatewayConfig(), tokenizer=Tokenizer.load(None))
    routes = _routes(app.routes)
    paths = sorted({r.path for r in routes if "GET" in (getattr(r, "methods", None) or set())})
    return [re.sub(r"\{[^}]*\}", model, p) if "{response_id}" not in p else p for p in paths]


def _no_key(text: str, where: str) -> None:
    assert INFERENCE_KEY not in text, f"the inference key in {where}"
    assert ADMIN_KEY not in text, f"the admin key in {where}"


def test_no_answer_and_no_log_holds_a_key(keyed):
    auth = {key: {"Authorization": f"Bearer {key}"} for key in (INFERENCE_KEY, ADMIN_KEY)}
    model = httpx.get(keyed.url + "/v1/models", headers=auth[INFERENCE_KEY]).json()["data"][0]["id"]
    paths = _get_paths(model)
    assert {"/get_server_info", "/server_info", "/workers", "/dashboard/data", "/metrics"} <= set(paths)
    status: dict[tuple[str, str], int] = {}
    with httpx.Client(base_url=keyed.url, timeout=120) as client:
        for key, headers in [*auth.items(), ("none", {})]:
            # a stored response of this key's own, for GET /v1/responses/{response_id}
            made = client.post(
                "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 2}, headers=headers
            )
            stored = made.json()["id"] if headers else "resp_none"
            for path in (p.replace("{response_id}", stored) for p in paths):
                r = client.get(path, headers=headers)
                _no_key(r.text, f"GET {path} with {key[:4]} ({r.status_code})")
                status[key, path] = r.status_code
            info = client.get("/get_server_info", headers=headers)
            if headers:
                assert info.status_code == 200 and "max_request_bytes" in info.json()
            for path, body in [
                ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
                ("/generate", {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 4}}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True}),
                ("/generate", {"text": PROMPT, "sampling_params": {"top_k": "x"}}),  # a 400
            ]:
                r = client.post(path, json=body, headers=headers)
                assert r.status_code in ((200, 400) if headers else (401,)), (path, r.status_code, r.text)
                _no_key(r.text, f"POST {path} with {key[:4]}")
    # Every path answered the admin key (its own and the inference ones), not just refused it.
    assert all(status[ADMIN_KEY, p] == 200 for p in paths if "{" not in p), status
    assert [s for (k, p), s in status.items() if k == ADMIN_KEY and p.startswith("/v1/responses/")] == [200]
    logs = glob.glob(os.path.join(keyed.log_dir, "*.log"))
    assert {"up.log", "gateway.log", "prefill-0.log", "decode-0.log"} <= {os.path.basename(p) for p in logs}
    for p in logs:
        _no_key(open(p, errors="replace").read(), p)


def test_a_tiny_temperature_is_greedy(keyed):
    headers = {"Authorization": f"Bearer {INFERENCE_KEY}"}
    outs = []
    for t in (0.0, 1e-38, 1e-6):
        body = {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": t, "ignore_eos": True},
        }
        r = httpx.post(keyed.url + "/generate", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        outs.append(r.json()["output_ids"])
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 8
