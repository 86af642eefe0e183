"""The gateway's edge against hostile input: no secret in the config it shows, big bodies parsed off the
event loop and bounded in flight, bounded rids, text that must be UTF-8, rooms closed on every failure,
clients counted by their normalized key, sampling values kept in the workers' ranges."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time

import pytest

from pdserve.gateway.config import GatewayConfig, public_config
from pdserve.gateway.generation import collector, generation, room_reader
from pdserve.gateway.request_models import MAX_RID_CHARS
from pdserve.protocol import gateway as m
from pdserve.sampling_params import SamplingParams

from .conftest import gateway_client

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


def _error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _idle(c) -> None:
    """No room open and nothing reserved on any worker."""
    gw = c.client.app.state.gw
    deadline = time.monotonic() + 2.0
    while gw.control.rooms and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not gw.control.rooms
    for w in gw.registry.all():
        assert (w.inflight_requests, w.inflight_tokens) == (0, 0), w.worker_id


# ---- no secret in a config dump ----------------------------------------------------------------


def test_public_config_leaves_out_every_secret_field():
    cfg = GatewayConfig(api_key="inf-key-1", admin_api_key="adm-key-2", cluster_secret_file="/s/secret")
    shown = public_config(cfg)
    assert not {"api_key", "admin_api_key", "cluster_secret_file"} & shown.keys()
    assert shown["max_request_bytes"] == cfg.max_request_bytes
    for text in (json.dumps(shown), repr(cfg)):
        assert "inf-key-1" not in text and "adm-key-2" not in text and "/s/secret" not in text


def test_server_info_with_the_inference_key_shows_no_key(tokenizer):
    with gateway_client(tokenizer, api_key="inf-key-1", admin_api_key="adm-key-2") as c:
        for path in ("/get_server_info", "/server_info"):
            r = c.get(path, headers={"Authorization": "Bearer inf-key-1"})
            assert r.status_code == 200 and "max_request_bytes" in r.json()
            assert "adm-key-2" not in r.text and "inf-key-1" not in r.text


# ---- big bodies ---------------------------------------------------------------------------------


def test_the_default_body_limit_is_4_mib_and_the_413_says_so(cluster):
    r = cluster.client.post("/generate", content=b'{"text": "' + b"a" * (4 << 20) + b'"}')
    err = _error(r, 413)
    assert "4194304 bytes" in err["message"] and "--max-request-bytes" in err["message"]


def test_weights_and_abort_bodies_are_small(cluster):
    """The admin endpoints' bodies are a few names: 64 KiB at most (they had no limit at all)."""
    big = b'{"model_path": "' + b"a" * (100 << 10) + b'"}'
    for path in ("/update_weights_from_disk", "/abort_request"):
        _error(cluster.client.post(path, content=big), 413)


def test_a_negative_max_new_tokens_is_a_400_not_a_500(cluster):
    """max_new_tokens -1 without min_new_tokens raised a KeyError in the min/max check (a 500, found by
    the random sampling parameters of tests/cluster/test_sampling_fuzz.py)."""
    for sp in (
        {"max_new_tokens": -1},
        {"max_new_tokens": -1, "min_new_tokens": 2},
        {"max_new_tokens": 1, "min_new_tokens": 2},
    ):
        err = _error(cluster.client.post("/generate", json={"text": "hi", "sampling_params": sp}))
        assert "max_new_tokens" in err["message"] or "min_new_tokens" in err["message"], err


def test_a_big_costly_body_is_parsed_off_the_event_loop(cluster):
    """Just under 4 MiB of empty lists took 2.5 s to parse on the event loop (json.loads and the
    model's checks); parsed in a thread with the collector paused, /health waits ~0.3 s at most."""
    body = json.dumps(GEN)[:-1].encode() + b', "x": [' + b"[]," * 1_390_000 + b"[]]}"
    assert len(body) < 4 << 20
    done = threading.Event()
    status: list[int] = []

    def big() -> None:
        status.append(cluster.client.post("/generate", content=body).status_code)
        done.set()

    t = threading.Thread(target=big)
    t.start()
    slowest = 0.0
    while not done.is_set():
        t0 = time.perf_counter()
        assert cluster.client.get("/health").status_code == 200
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.02)
    t.join()
    assert status == [200]
    assert slowest < 1.0, f"/health took {slowest:.2f} s while a 4 MiB body was parsed"
    assert cluster.client.app.state.gw.admission.body_bytes == 0


def test_bodies_in_flight_are_bounded_gateway_wide(wire_cluster):
    c = wire_cluster(max_inflight_body_bytes=6000)
    big = {"text": "a " * 4000, "sampling_params": {"max_new_tokens": 1}}
    err = _error(c.client.post("/generate", json=big), 429)
    assert "6000 bytes" in err["message"] and err["code"] == "rate_limit_exceeded"
    assert c.client.app.state.gw.admission.body_bytes == 0  # given back
    assert c.client.post("/generate", json=GEN).status_code == 200


# ---- rid ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/generate", {**GEN, "rid": "r" * (MAX_RID_CHARS + 1)}),
        ("/generate", {"text": ["a", "b"], "rid": ["ok", "r" * (MAX_RID_CHARS + 1)]}),
        ("/v1/completions", {"prompt": "hi", "rid": "r" * (MAX_RID_CHARS + 1)}),
        ("/v1/chat/completions", {**CHAT, "rid": "r" * (MAX_RID_CHARS + 1)}),
        ("/abort_request", {"rid": "r" * (MAX_RID_CHARS + 1)}),
    ],
)
def test_a_long_rid_is_a_400_naming_it(cluster, path, body):
    err = _error(cluster.client.post(path, json=body))
    assert err["param"] == "rid" and f"at most {MAX_RID_CHARS} characters" in err["message"]
    assert not cluster.decode.requests()


def test_a_rid_of_the_longest_length_passes(cluster):
    r = cluster.client.post("/generate", json={**GEN, "rid": "r" * MAX_RID_CHARS})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "r" * MAX_RID_CHARS


# ---- text that is not UTF-8 -----------------------------------------------------------------------


def _raw(obj: dict) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate travels as its \u escape


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", _raw({"text": "a\udc00b"}), "text"),
        ("/generate", _raw({**GEN, "rid": "\udc00"}), "rid"),
        ("/generate", _raw({"text": "hi", "sampling_params": {"stop": ["\udc00"]}}), "sampling_params.stop.0"),
        ("/generate", b'{"text": "caf\xe9 au lait"}', "text"),  # Latin-1, not UTF-8
        ("/generate", b'{"text": "x\xed\xb0\x80"}', "text"),  # a surrogate encoded as UTF-8
        ("/v1/chat/completions", _raw({"messages": [{"role": "user", "content": "\ud800"}]}), "messages.0.content"),
        ("/v1/completions", _raw({"prompt": "hi", "stop": "\udfff"}), "stop"),
        ("/v1/completions", _raw({"prompt": "hi", "logit_bias": {"\udc00": 1}}), "logit_bias"),
        ("/v1/chat/completions", _raw({**CHAT, "rid": "\udc00"}), "rid"),
    ],
)  # fmt: skip
def test_text_that_is_not_utf8_is_a_400_naming_the_field(cluster, path, body, param):
    err = _error(cluster.client.post(path, content=body, headers={"content-type": "application/json"}))
    assert err["param"] == param and "not valid UTF-8" in err["message"], err
    assert not cluster.prefill.requests() and not cluster.decode.requests()
    _idle(cluster)


def test_valid_surrogate_pairs_and_emoji_pass(cluster):
    r = cluster.client.post("/generate", content=_raw({**GEN, "text": "hi \U0001f600", "rid": "\U0001f600"}))
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "\U0001f600"


# ---- the room's cleanup ---------------------------------------------------------------------------


def _boom(*_a, **_k):
    raise RuntimeError("injected")


def _fail_on_role(role: str, send):
    def wrapped(worker, msg):
        if isinstance(msg, m.GenerateRequest) and worker.role == role:
            raise RuntimeError("injected")
        return send(worker, msg)

    return wrapped


# Each step after the room opens; (target, attribute, replacement factory).
STEPS = {
    "request": lambda gw: (generation, "GenerateRequest", _boom),
    "send_prefill": lambda gw: (gw.control, "send", _fail_on_role("prefill", gw.control.send)),
    "send_decode": lambda gw: (gw.control, "send", _fail_on_role("decode", gw.control.send)),
    "routed_metric": lambda gw: (gw.metrics, "routed", None),
    "next_event": lambda gw: (room_reader.RoomReader, "next", _boom),
    "collect": lambda gw: (collector.Collector, "feed", _boom),
    "prefill_done_wait": lambda gw: (gw.generations, "_wait_prefill_done", _boom),
    "meta_info": lambda gw: (generation, "build_meta_info", _boom),
    "finish": lambda gw: (gw.generations, "on_finish", _boom),
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_after_the_room_opens_closes_it(cluster, monkeypatch, step, stream):
    gw = cluster.client.app.state.gw
    target, attr, replacement = STEPS[step](gw)
    monkeypatch.setattr(target, attr, replacement)
    r = cluster.client.post("/generate", json={**GEN, "stream": stream})
    if stream:  # the failure comes inside the stream, as an error event before [DONE]
        assert r.status_code == 200 and "[DONE]" in r.text and "error" in r.text, r.text
    else:
        assert r.status_code == 500, r.text
    _idle(cluster)
    monkeypatch.undo()
    assert cluster.client.post("/generate", json=GEN).status_code == 200
    _idle(cluster)


def test_the_dashboard_never_fails_on_a_stored_request(wire_cluster):
    c = wire_cluster(admin_api_key="adm")
    assert c.client.post("/generate", json={**GEN, "rid": "good"}).status_code == 200
    gw = c.client.app.state.gw
    good = next(iter(gw.recent))
    gw.recent.add(dataclasses.replace(good, rid="bad\udc00"))
    gw.recent.add(dataclasses.replace(good, rid="nan", start=math.nan))
    r = c.client.get("/dashboard/data", headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200
    assert [q["rid"] for q in r.json()["requests"]] == ["good"]


# ---- clients by their normalized key ---------------------------------------------------------------


def test_respelled_bearer_headers_are_one_client(wire_cluster):
    c = wire_cluster(api_key="k", max_requests_per_client=1)
    c.decode.kv_wait_s = 1.5  # the first request stays in flight that long
    first: list[int] = []
    t = threading.Thread(
        target=lambda: first.append(
            c.client.post("/generate", json=GEN, headers={"Authorization": "Bearer k"}).status_code
        )
    )
    t.start()
    time.sleep(0.5)
    for spelling in ("bearer k", "BEARER  k", "Bearer k "):
        r = c.client.post("/generate", json=GEN, headers={"Authorization": spelling})
        assert r.status_code == 429, (spelling, r.text)
    t.join()
    assert first == [200]


# ---- sampling values in the workers' ranges ---------------------------------------------------------


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=1e-38).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [2**63]}}, "sampling_params.stop_token_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [49152]}}, "sampling_params.stop_token_ids"),
        ("/generate", {"text": "hi", "sampling_params": [{"stop_token_ids": [-1]}]}, "sampling_params.0.stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {str(2**63): 1}}, "logit_bias"),
        ("/generate", {"text": "hi", "sampling_params": {"seed": 2**63}}, "sampling_params.seed"),
        ("/v1/chat/completions", {**CHAT, "seed": -1}, "seed"),
        ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 2**63}, "logprob_start_len"),
    ],
)  # fmt: skip
def test_out_of_range_token_ids_and_seeds_are_400s(cluster, path, body, param):
    err = _error(cluster.client.post(path, json=body))
    assert err["param"] == param, err
    assert not cluster.prefill.requests()


def test_values_past_their_range_reach_the_workers_in_range(cluster):
    sp = {"max_new_tokens": 4, "top_k": 2**63, "seed": 2**63 - 1, "n": 2, "temperature": 1e-38}
    assert cluster.client.post("/generate", json={"text": "hi", "sampling_params": sp}).status_code == 200
    r = cluster.client.post(
        "/v1/completions", json={"prompt": "hi", "top_k": 10**30, "seed": 2**63 - 1, "n": 2}
    )
    assert r.status_code == 200
    sent = [req.sampling for req in cluster.prefill.requests()]
    assert sorted(s.seed for s in sent) == [0, 0, 2**63 - 1, 2**63 - 1]  # seed + j wraps within int64
    assert all(s.top_k == -1 for s in sent)  # top_k of the vocabulary or more: no top-k
    assert [s.temperature for s in sent] == [0.0, 0.0, 1.0, 1.0]  # 1e-38 is greedy


# ---- a client that leaves mid-body -------------------------------------------------------------------


def test_a_client_leaving_mid_body_is_one_info_line(tokenizer, caplog):
    """Driven as the ASGI server drives it: part of the body, then the disconnect."""
    import asyncio

    app = gateway_client(tokenizer).app
    sent: list[dict] = []
    incoming = [
        {"type": "http.request", "body": b'{"text": "', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100000")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 30000),
    }
    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))
    ours = [r for r in caplog.records if r.name.startswith("pdserve")]
    assert not [r for r in ours if r.levelno >= logging.WARNING], [r.getMessage() for r in ours]
    gone = [r for r in ours if "left before its request body" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert app.state.gw.admission.body_bytes == 0 and app.state.gw.admission.requests == 0


@pytest.mark.timeout(120)
def test_stalled_bodies_are_bounded_over_real_sockets(tmp_path):
    """`pdserve gateway` under uvicorn: two stalled bodies of one client pass the gateway-wide bound
    (the second is a 429 before it is all in), a client that leaves mid-body gives its bytes back
    and logs one INFO line."""
    import socket

    import httpx
    from harness import start_gateway, stop_processes

    flags = ["--max-inflight-body-bytes", "200000", "--max-request-bytes", "150000", "--log-level", "info"]
    proc, port, _ = start_gateway(str(tmp_path), flags)

    def stalled(declared: int, sent: int) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}"
        s.sendall(head.encode() + b"\r\n\r\n" + b'{"text": "' + b"a" * (sent - 10))
        return s

    try:
        first = stalled(120_000, 100_000)
        time.sleep(0.5)
        second = stalled(120_000, 110_000)
        assert second.recv(4096).startswith(b"HTTP/1.1 429"), "the second stalled body was not refused"
        second.close()
        url = f"http://127.0.0.1:{port}/generate"
        assert httpx.post(url, json=GEN).status_code == 503  # room for a small body (no workers: 503)
        first.close()
        time.sleep(0.5)
        assert httpx.post(url, json={"text": "a" * 120_000}).status_code == 503  # its bytes were given back
    finally:
        stop_processes([proc], grace_s=10)
    log = (tmp_path / "gateway.log").read_text()
    assert "Traceback" not in log and " ERROR " not in log
    assert log.count("left before its request body was in") == 1
