"""OpenTelemetry traces from a real cluster into a real OTLP receiver (HTTP and gRPC): one trace per
request, every span, parent links, and the spans nested in time on the gateway's clock, also with the
workers' clocks seconds off."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_roles, start_up
from otlp_receiver import GrpcReceiver, HttpReceiver

CHILDREN = {"prefill.queue", "prefill.forward", "kv_transfer.send", "decode.admission", "kv_transfer.recv",
            "decode", "response"}  # fmt: skip
LONG = " ".join(["The quick brown fox jumps over the lazy dog near the old river bank."] * 30)
EPS = 2e-6  # nanosecond rounding of the exported times


def _generate(url: str, text: str, n: int, headers: dict | None = None, stream: bool = False) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if stream:
        body["stream"] = True
        with httpx.stream("POST", url + "/generate", json=body, headers=headers, timeout=300) as r:
            assert r.status_code == 200
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    last = line[6:]
        import json

        return json.loads(last)
    r = httpx.post(url + "/generate", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _check_trace(spans: list[dict], mi: dict, chunk_size: int | None = None) -> dict[str, list[dict]]:
    """Asserts the trace of one request; returns its spans by name."""
    (root,) = [s for s in spans if s["name"] == "request"]
    by: dict[str, list[dict]] = {}
    for s in spans:
        by.setdefault(s["name"], []).append(s)
    assert set(by) == CHILDREN | {"request"}, sorted(by)
    for name in CHILDREN - {"prefill.forward"}:
        assert len(by[name]) == 1, (name, len(by[name]))
    assert root["attributes"]["pdserve.rid"] == mi["id"]
    for s in spans:
        if s is not root:
            assert s["parent_span_id"] == root["span_id"], s["name"]
            # Nested in the root's time, and not inverted.
            assert root["start"] - EPS <= s["start"] <= s["end"] + EPS <= root["end"] + 2 * EPS, s
    # The root and the phases are meta_info's times (the gateway clock).
    assert root["start"] == pytest.approx(mi["request_received_ts"], abs=EPS)
    forwards = sorted(by["prefill.forward"], key=lambda s: s["attributes"]["pdserve.chunk"])
    assert forwards[0]["start"] == pytest.approx(mi["forward_entry_time"], abs=EPS)
    assert forwards[-1]["end"] == pytest.approx(mi["prefill_finished_time"], abs=EPS)
    for a, b in zip(forwards, forwards[1:]):  # chunks one after another
        assert a["end"] <= b["start"] + EPS
    if chunk_size:
        # A forward takes at most chunk_size tokens (shared with other prompts in the batch).
        assert len(forwards) >= math.ceil(mi["prompt_tokens"] / chunk_size), len(forwards)
    (queue,) = by["prefill.queue"]
    assert queue["end"] == pytest.approx(mi["forward_entry_time"], abs=EPS)
    (decode,) = by["decode"]
    assert decode["end"] == pytest.approx(mi["request_finished_ts"], abs=EPS)
    assert decode["attributes"]["pdserve.completion_tokens"] == mi["completion_tokens"]
    assert decode["attributes"]["pdserve.spec.verify_ct"] == mi["spec_verify_ct"]
    (send,), (recv,), (adm,) = by["kv_transfer.send"], by["kv_transfer.recv"], by["decode.admission"]
    assert send["start"] == pytest.approx(mi["prefill_finished_time"], abs=EPS)
    assert send["end"] == pytest.approx(recv["end"], abs=EPS) == pytest.approx(decode["start"], abs=EPS)
    assert adm["end"] == pytest.approx(recv["start"], abs=EPS)
    for s in (send, recv):
        assert s["attributes"]["pdserve.kv.path"] in ("shm", "gloo/direct", "gloo/staged")
        assert s["attributes"]["pdserve.kv.bytes"] > 0
    # Real work took real time: an offset ignored clamps these spans to nothing.
    assert sum(f["end"] - f["start"] for f in forwards) > 0.5 * (
        mi["prefill_finished_time"] - mi["forward_entry_time"]
    )
    assert decode["end"] - decode["start"] > 0
    return by


@pytest.mark.timeout(400)
def test_traces_over_otlp_http_from_pdserve_up(tmp_path):
    rx = HttpReceiver()
    c = start_up(tmp_path, extra=["--enable-trace", "--otlp-traces-endpoint", rx.url,
                                  "--chunked-prefill-size", "128"])  # fmt: skip
    try:
        c.wait_healthy()
        # The client's own trace: the request's root is its child.
        parent_trace, parent_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        headers = {"traceparent": f"00-{parent_trace}-{parent_span}-01"}
        texts = [f"Request {i}. {LONG}" for i in range(4)]
        with ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(_generate, c.url, t, 6, headers if i == 0 else None, i == 1)
                    for i, t in enumerate(texts)]  # fmt: skip
            outs = [f.result() for f in futs]
        traces = rx.store.wait_roots(len(outs))
    finally:
        c.stop()
        rx.close()
    assert len(traces) == len(outs)  # one trace per request
    by_rid = {}
    for spans in traces.values():
        (root,) = [s for s in spans if s["name"] == "request"]
        by_rid[root["attributes"]["pdserve.rid"]] = (root, spans)
    for i, out in enumerate(outs):
        mi = out["meta_info"]
        root, spans = by_rid[mi["id"]]
        _check_trace(spans, mi, chunk_size=128)
        assert root["resource"]["service.name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        if i == 0:
            assert root["trace_id"] == parent_trace and root["parent_span_id"] == parent_span
        else:
            assert root["parent_span_id"] == "" and root["trace_id"] != parent_trace


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_traces_over_otlp_grpc_with_skewed_worker_clocks(tmp_path):
    # The prefill clock runs 7 s ahead, the decode clock 4 s behind; spans are still on the gateway's.
    rx = GrpcReceiver()
    c = start_roles(
        tmp_path,
        [("prefill", {}, ["--test-clock-skew", "7"]), ("decode", {}, ["--test-clock-skew", "-4"])],
        gateway_flags=[
            "--enable-trace",
            "--otlp-traces-endpoint",
            rx.endpoint,
            "--otlp-traces-protocol",
            "grpc",
        ],
    )
    try:
        c.wait_healthy()
        _generate(c.url, "Warm up.", 2)  # the pair group is built
        outs = [_generate(c.url, f"Run {i}. {LONG}", 16) for i in range(2)]
        traces = rx.store.wait_roots(3)
    finally:
        c.stop()
        rx.close()
    assert len(traces) == 3
    for out in outs:
        mi = out["meta_info"]
        (spans,) = [
            sp for sp in traces.values() if any(s["attributes"].get("pdserve.rid") == mi["id"] for s in sp)
        ]
        by = _check_trace(spans, mi)
        # The gateway's own witnesses bound the workers' mapped times: the prefill starts soon after
        # dispatch and the final output arrives right after the decode finished.
        (root,), (queue,), (decode,) = by["request"], by["prefill.queue"], by["decode"]
        assert queue["start"] - mi["api_server_dispatch_finish_ts"] < 1.0
        assert root["end"] - decode["end"] < 1.0
