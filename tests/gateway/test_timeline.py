"""Timeline stitching across skewed clocks, and the NTP offset estimator."""

from __future__ import annotations

import math
import random

import pytest

from pdserve.gateway.cluster.clock import OffsetEstimator, ntp_sample
from pdserve.gateway.observe.timeline import (
    Timeline,
    TimelineInput,
    decode_throughput,
    spec_accept_length,
    spec_accept_rate,
    stitch,
)

ORDER = [
    "request_received_ts",
    "api_server_dispatch_finish_ts",
    "forward_entry_time",
    "prefill_finished_time",
    "first_token_ts",
    "request_finished_ts",
    "response_sent_to_client_ts",
]


def _ordered(tl: Timeline) -> bool:
    vals = [getattr(tl, k) for k in ORDER]
    return all(a <= b for a, b in zip(vals, vals[1:]))


def _scenario(
    prefill_skew: float, decode_skew: float, prefill_err: float, decode_err: float
) -> TimelineInput:
    """A true timeline on the gateway clock, reported by workers whose clocks are skewed.

    The offsets handed to `stitch` are the true skews plus an estimate error.
    """
    t = 1_000_000.0
    true = dict(
        received=t,
        dispatched=t + 0.001,
        queue_entry=t + 0.002,
        forward_entry=t + 0.003,
        prefill_finished=t + 0.020,
        prefill_done_recv=t + 0.021,
        decode_entry=t + 0.002,
        kv_ready=t + 0.022,
        first_recv=t + 0.025,
        finished=t + 0.300,
        final_recv=t + 0.301,
        sent=t + 0.302,
    )
    return TimelineInput(
        request_received=true["received"],
        dispatch_finished=true["dispatched"],
        first_token_recv=true["first_recv"],
        final_recv=true["final_recv"],
        response_sent=true["sent"],
        prefill_done_recv=true["prefill_done_recv"],
        prefill_events={
            k: true[k] + prefill_skew for k in ("queue_entry", "forward_entry", "prefill_finished")
        },
        prefill_offset=prefill_skew + prefill_err,
        decode_events={k: true[k] + decode_skew for k in ("decode_entry", "kv_ready", "finished")},
        decode_offset=decode_skew + decode_err,
        completion_tokens=12,
    )


def test_exact_offsets_recover_true_times():
    tl = stitch(_scenario(5.0, -5.0, 0.0, 0.0))
    assert tl.forward_entry_time == pytest.approx(1_000_000.003)
    assert tl.prefill_finished_time == pytest.approx(1_000_000.020)
    assert tl.request_finished_ts == pytest.approx(1_000_000.300)
    assert tl.queue_time == pytest.approx(0.001)
    assert tl.first_token_latency == pytest.approx(0.025)
    assert tl.e2e_latency == pytest.approx(0.300)
    assert _ordered(tl)


@pytest.mark.parametrize("prefill_skew", [-5.0, 0.0, 5.0])
@pytest.mark.parametrize("decode_skew", [-5.0, 5.0])
@pytest.mark.parametrize("err", [-0.05, -0.004, 0.004, 0.05, 2.0])
def test_skewed_clocks_with_estimate_error_stay_ordered(prefill_skew, decode_skew, err):
    tl = stitch(_scenario(prefill_skew, decode_skew, err, -err))
    assert _ordered(tl), tl
    # Nothing may be placed after the receipt of the message that carried it.
    assert tl.prefill_finished_time <= 1_000_000.021
    assert tl.request_finished_ts <= 1_000_000.301
    # queue_time is a duration on one clock: offsets do not touch it.
    assert tl.queue_time == pytest.approx(0.001)


def test_random_skews_and_errors_always_ordered():
    rng = random.Random(0)
    for _ in range(500):
        inp = _scenario(rng.uniform(-5, 5), rng.uniform(-5, 5), rng.gauss(0, 0.1), rng.gauss(0, 0.1))
        assert _ordered(stitch(inp))


def test_small_error_moves_times_by_at_most_the_error():
    tl = stitch(_scenario(5.0, -5.0, 0.001, 0.001))
    assert abs(tl.forward_entry_time - 1_000_000.003) <= 0.001 + 1e-9
    assert abs(tl.request_finished_ts - 1_000_000.300) <= 0.001 + 1e-9


def test_missing_prefill_done_falls_back_to_decode_kv_ready():
    inp = _scenario(0.0, 3.0, 0.0, 0.0)
    inp = TimelineInput(**{**inp.__dict__, "prefill_events": {}, "prefill_done_recv": None})
    tl = stitch(inp)
    assert _ordered(tl)
    assert tl.forward_entry_time == inp.dispatch_finished
    assert tl.prefill_finished_time == pytest.approx(1_000_000.022)
    assert tl.queue_time == 0.0


def test_late_prefill_done_still_bounded_by_first_token():
    inp = _scenario(0.0, 0.0, 0.0, 0.0)
    # PrefillDone arrived after the first tokens and its clock claims a later finish.
    inp = TimelineInput(
        **{
            **inp.__dict__,
            "prefill_done_recv": 1_000_000.2,
            "prefill_events": {"forward_entry": 1_000_000.1, "prefill_finished": 1_000_000.15},
        }
    )
    tl = stitch(inp)
    assert _ordered(tl)
    assert tl.prefill_finished_time <= tl.first_token_ts


def test_derived_numbers():
    assert decode_throughput(12, 10.0, 10.5) == pytest.approx(22.0)
    assert decode_throughput(1, 10.0, 10.5) == 0.0
    assert decode_throughput(5, 10.0, 10.0) == 0.0
    assert spec_accept_rate(5, 18) == pytest.approx(0.2777777777777778)
    assert spec_accept_rate(0, 0) == 0.0
    assert spec_accept_length(12, 6) == 2.0
    assert spec_accept_length(12, 0) == 0.0


# ---- clock offsets -------------------------------------------------------------------------------


def test_ntp_sample_symmetric_path_is_exact():
    # Worker clock is 5 s ahead; 10 ms each way; 2 ms of processing.
    t0 = 100.0
    t1 = t0 + 0.010 + 5.0
    t2 = t1 + 0.002
    t3 = t0 + 0.022
    s = ntp_sample(t0, t1, t2, t3)
    assert s.offset == pytest.approx(5.0)
    assert s.rtt == pytest.approx(0.020)


def test_estimator_prefers_smallest_rtt_and_bounds_error():
    est = OffsetEstimator(window=8)
    assert est.offset == 0.0
    est.add_one_way(t_worker_send=105.3, t_gateway_recv=100.0)  # weak: transit time unknown
    assert est.offset == pytest.approx(5.3)
    assert math.isinf(est.best().rtt)
    rng = random.Random(1)
    true = -5.0
    for i in range(8):
        t0 = 200.0 + i
        up, down = rng.uniform(0.001, 0.05), rng.uniform(0.001, 0.05)
        t1 = t0 + up + true
        t2 = t1 + 0.001
        t3 = t0 + up + 0.001 + down
        est.add_round_trip(t0, t1, t2, t3)
    best = est.best()
    assert best.rtt == min(s.rtt for s in est._samples)
    assert abs(est.offset - true) <= best.rtt / 2 + 1e-9
    assert est.to_gateway(300.0 + true) == pytest.approx(300.0, abs=best.rtt / 2 + 1e-9)


def test_estimator_forgets_old_samples():
    est = OffsetEstimator(window=2)
    est.add_round_trip(0.0, 1.0, 1.0, 0.0)  # rtt 0, offset 1
    est.add_round_trip(10.0, 12.0, 12.0, 10.1)
    est.add_round_trip(20.0, 22.0, 22.0, 20.1)
    assert est.offset == pytest.approx(1.95)  # the rtt-0 sample fell out of the window
