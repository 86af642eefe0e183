"""A request's spans and phases from skewed worker clocks (pure), and the dashboard's bounded ring."""

from __future__ import annotations

import random

import pytest

from pdserve.gateway.api.dashboard import RecentRequests
from pdserve.gateway.generation.request_trace import PHASES, TraceInput, build_trace
from pdserve.gateway.observe.timeline import TimelineInput, stitch

T = 1_000_000.0
TRUE = dict(
    received=T,
    dispatched=T + 0.001,
    queue_entry=T + 0.002,
    forward_entry=T + 0.003,
    prefill_finished=T + 0.040,
    prefill_done_recv=T + 0.041,
    decode_entry=T + 0.002,
    kv_requested=T + 0.0025,
    kv_ready=T + 0.045,
    first_recv=T + 0.046,
    finished=T + 0.300,
    final_recv=T + 0.301,
    sent=T + 0.302,
)
CHUNKS = [(T + 0.003, T + 0.020), (T + 0.021, T + 0.040)]


def _trace(prefill_skew: float, decode_skew: float, err: float):
    pe = {k: TRUE[k] + prefill_skew for k in ("queue_entry", "forward_entry", "prefill_finished")}
    # The gateway maps the decode's events as they arrive (with its offset estimate).
    de = {
        k: TRUE[k] + decode_skew - (decode_skew - err)
        for k in ("decode_entry", "kv_requested", "kv_ready", "finished")
    }
    tl = stitch(
        TimelineInput(
            request_received=TRUE["received"],
            dispatch_finished=TRUE["dispatched"],
            first_token_recv=TRUE["first_recv"],
            final_recv=TRUE["final_recv"],
            response_sent=TRUE["sent"],
            prefill_done_recv=TRUE["prefill_done_recv"],
            prefill_events=pe,
            prefill_offset=prefill_skew + err,
            decode_events=de,
            decode_offset=0.0,
            completion_tokens=20,
        )
    )
    return build_trace(
        TraceInput(
            rid="r1",
            tl=tl,
            prefill_worker="prefill-0",
            decode_worker="decode-0",
            prefill_events=pe,
            prefill_offset=prefill_skew + err,
            forward_chunks=[(s + prefill_skew, e + prefill_skew) for s, e in CHUNKS],
            decode_events=de,
            stats={"transfer_bytes": 4096, "kv_path": "gloo/direct", "spec_verify_ct": 7},
            prompt_tokens=100,
            completion_tokens=20,
            cached_tokens=32,
            migrations=0,
            meta_info={"id": "r1", "output_token_logprobs": [[-0.1, 5, None]]},
        )
    )


def test_exact_offsets_give_the_true_spans():
    t = _trace(7.0, -4.0, 0.0)
    by = {(s.name, s.attributes.get("pdserve.chunk")): s for s in t.spans}
    assert by["prefill.queue", None].start == pytest.approx(TRUE["queue_entry"])
    for i, (s, e) in enumerate(CHUNKS):
        assert (by["prefill.forward", i].start, by["prefill.forward", i].end) == pytest.approx((s, e))
    assert by["kv_transfer.recv", None].start == pytest.approx(TRUE["kv_requested"])
    assert by["decode", None].start == pytest.approx(TRUE["kv_ready"])
    assert by["decode", None].attributes["pdserve.spec.verify_ct"] == 7
    assert by["kv_transfer.send", None].attributes["pdserve.kv.bytes"] == 4096
    assert t.phases["prefill"] == pytest.approx(0.037)
    assert "output_token_logprobs" not in t.to_json()["meta_info"]  # token ids are the text


def test_skews_and_estimate_errors_keep_spans_nested_and_phases_whole():
    rng = random.Random(7)
    for _ in range(300):
        t = _trace(rng.uniform(-10, 10), rng.uniform(-10, 10), rng.uniform(-0.05, 0.05))
        for s in t.spans:
            assert t.start <= s.start <= s.end <= t.end, s
        assert list(t.phases) == list(PHASES)
        assert all(v >= 0 for v in t.phases.values()), t.phases
        assert sum(t.phases.values()) == pytest.approx(t.end - t.start)


def test_recent_requests_ring_is_bounded():
    ring = RecentRequests(3)
    for _ in range(5):
        ring.add(_trace(0.0, 0.0, 0.0))
    assert len(ring) == 3


def test_a_local_prefill_has_one_forward_span_and_no_kv_path():
    t = _trace(0.0, 0.0, 0.0)
    local = build_trace(
        TraceInput(
            rid="r2",
            tl=stitch(
                TimelineInput(
                    request_received=TRUE["received"],
                    dispatch_finished=TRUE["dispatched"],
                    first_token_recv=TRUE["first_recv"],
                    final_recv=TRUE["final_recv"],
                    response_sent=TRUE["sent"],
                    prefill_done_recv=TRUE["first_recv"],
                    prefill_events={k: TRUE[k] for k in ("queue_entry", "forward_entry", "prefill_finished")},
                    prefill_offset=0.0,
                    decode_events={},
                    decode_offset=0.0,
                    completion_tokens=20,
                )
            ),
            prefill_worker="",
            decode_worker="decode-0",
            prefill_events={k: TRUE[k] for k in ("queue_entry", "forward_entry", "prefill_finished")},
            prefill_offset=0.0,
            forward_chunks=[],
            decode_events={},
            stats={"kv_path": "local"},
            prompt_tokens=10,
            completion_tokens=20,
            cached_tokens=0,
            migrations=0,
            meta_info={},
        )
    )
    forwards = [s for s in local.spans if s.name == "prefill.forward"]
    assert len(forwards) == 1 and forwards[0].attributes["pdserve.worker"] == "decode-0"
    assert (forwards[0].start, forwards[0].end) == pytest.approx(
        (TRUE["forward_entry"], TRUE["prefill_finished"])
    )
    assert local.attributes["pdserve.prefill_worker"] == "local"
    assert {s.attributes.get("pdserve.kv.path") for s in local.spans if s.name.startswith("kv_")} == {"local"}
    assert len(t.spans) == len(local.spans) + 1  # the transferred request had two forward chunks
