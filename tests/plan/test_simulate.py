"""The cluster simulator against cases computed by hand: one request, a fixed batch, and two forwards
sharing one host's cores."""

from __future__ import annotations

import pytest

from pdserve.plan.goodput import Capacity, capacity, goodput
from pdserve.plan.profile import Profile
from pdserve.plan.simulate import Arrival, poisson_workload, simulate


def _profile(prefill_s=(1.0, 1.0), decode_s=((0.1, 0.1), (0.1, 0.1)), transfer=0.0, **kw) -> Profile:
    return Profile(
        host="test",
        model="m",
        dtype="float32",
        quantization="none",
        threads=2,
        prefill_tokens=[1, 1000],
        prefill_s=list(prefill_s),
        decode_batch=[1, 8],
        decode_context=[1, 1000],
        decode_s=[list(r) for r in decode_s],
        transfer_s_per_token=transfer,
        **kw,
    )


def test_interpolation_between_and_past_the_measured_points() -> None:
    p = _profile(prefill_s=(0.1, 10.0), decode_s=((0.01, 0.02), (0.05, 0.06)))
    assert p.prefill(1) == pytest.approx(0.1) and p.prefill(1000) == pytest.approx(10.0)
    assert p.prefill(500.5) == pytest.approx(5.05)
    assert p.prefill(1999) == pytest.approx(19.9)  # the last segment, extended
    assert p.decode(1, 1) == pytest.approx(0.01) and p.decode(8, 1000) == pytest.approx(0.06)
    assert p.decode(4.5, 500.5) == pytest.approx((0.015 + 0.055) / 2)


def test_one_request_alone() -> None:
    """TTFT is one prefill; every later token one batch-1 step after the KV lands."""
    p = _profile(prefill_s=(0.0, 0.999), transfer=0.002)  # prefill(n) = 0.001 (n - 1)
    (o,) = simulate(p, 1, 1, [Arrival(0.5, 101, 11)])
    assert o.ttft == pytest.approx(0.1)
    assert o.done == pytest.approx(0.5 + 0.1 + 101 * 0.002 + 10 * 0.1)
    assert o.tpot == pytest.approx((101 * 0.002 + 1.0) / 10)


def test_a_fixed_batch_prefills_together_and_decodes_together() -> None:
    p = _profile(prefill_s=(0.0, 0.999), decode_s=((0.1, 0.1), (0.8, 0.8)))  # step(b) = 0.1 b
    outs = simulate(p, 1, 1, [Arrival(0.0, 50, 5)] * 4)
    for o in outs:
        assert o.ttft == pytest.approx(0.001 * 199)  # one forward over 4 x 50 tokens
        assert o.done == pytest.approx(0.199 + 4 * 0.4)  # four steps of batch 4
    # Over the chunk budget: the fourth prompt waits for the next forward.
    p.chunked_prefill_size = 150
    outs = simulate(p, 1, 1, [Arrival(0.0, 50, 1)] * 4)
    assert [o.ttft for o in outs] == pytest.approx([0.149] * 3 + [0.149 + 0.049])


def test_two_forwards_on_one_host_share_its_cores() -> None:
    """A decodes while B prefills: both run at half speed (worked out in the module's terms)."""
    p = _profile()  # prefill 1 s whatever the length, steps 0.1 s
    a, b = simulate(p, 1, 1, [Arrival(0.0, 10, 3), Arrival(1.0, 10, 3)])
    assert a.ttft == pytest.approx(1.0) and a.done == pytest.approx(1.4)
    assert b.ttft == pytest.approx(1.2) and b.done == pytest.approx(2.4)
    # Each worker on a device of its own: nothing shared.
    a, b = simulate(p, 1, 1, [Arrival(0.0, 10, 3), Arrival(1.0, 10, 3)], shared=False)
    assert (a.ttft, a.done, b.ttft, b.done) == pytest.approx((1.0, 1.2, 1.0, 2.2))


def test_routing_spreads_requests_and_goodput_counts_the_ones_within_targets() -> None:
    p = _profile()
    outs = simulate(p, 2, 1, [Arrival(0.0, 10, 2), Arrival(0.0, 10, 2)], shared=False)
    assert [o.ttft for o in outs] == pytest.approx([1.0, 1.0])  # one prefill worker each
    g = goodput(outs, ttft_slo=1.0, tpot_slo=0.11)
    assert g["good"] == 2 and g["goodput"] == pytest.approx(2 / 1.1)
    assert goodput(outs, ttft_slo=0.5, tpot_slo=0.11)["good"] == 0


def test_poisson_workload_is_seeded_and_sized() -> None:
    w = poisson_workload(4.0, 400, 512, 64, seed=3, range_ratio=0.5)
    assert w == poisson_workload(4.0, 400, 512, 64, seed=3, range_ratio=0.5)
    assert len(w) == 400 and all(256 <= a.prompt <= 512 and 32 <= a.output <= 64 for a in w)
    assert 80 < w[-1].at < 120  # ~100 s of arrivals at 4/s


def test_a_damaged_profile_is_refused(tmp_path) -> None:
    p = _profile()
    p.decode_s = [[0.1]]
    path = tmp_path / "p.json"
    p.save(str(path))
    with pytest.raises(ValueError, match="decode_s must be"):
        Profile.load(str(path))


def test_shared_efficiency_slows_overlapping_forwards_and_is_fitted_back() -> None:
    from pdserve.plan.measure_cluster import fit_efficiency, fit_trace

    p = _profile()
    p.shared_efficiency = 0.5
    a, b = simulate(p, 1, 1, [Arrival(0.0, 10, 3), Arrival(1.0, 10, 3)])
    # as in the half-speed case above, at a quarter of the speed while both run
    assert a.done == pytest.approx(1.8) and b.ttft == pytest.approx(0.8 + 0.8)  # 0.2 of it shared, 0.8 alone

    # The open-loop trace `--url` runs, simulated at efficiency 0.5, gives a mean time to the last token
    # from which the fit finds 0.5 again.
    def linear(e: float = 1.0) -> Profile:  # prefill time in proportion to the prompt, 20 ms steps
        return _profile(prefill_s=(0.001, 1.0), decode_s=((0.02, 0.02), (0.03, 0.03)), shared_efficiency=e)

    trace = fit_trace(linear())
    assert len(trace) == 24 and all(512 <= a.prompt <= 1024 and 16 <= a.output <= 32 for a in trace)
    outs = simulate(linear(0.5), 1, 1, trace)
    measured = sum(o.done - o.arrival for o in outs) / len(outs)
    assert fit_efficiency(linear(), [trace], measured) == pytest.approx(0.5, abs=0.01)
    assert fit_efficiency(linear(), [trace], 0.001) == 1.0  # faster than perfect
    # Two traces pooled: the mean over all their requests (an answer-heavy one beside it).
    answers = fit_trace(linear(), prompt=64, output=256)
    assert all(32 <= a.prompt <= 64 and 128 <= a.output <= 256 for a in answers)
    both = [o.done - o.arrival for t in (trace, answers) for o in simulate(linear(0.5), 1, 1, t)]
    assert fit_efficiency(linear(), [trace, answers], sum(both) / len(both)) == pytest.approx(0.5, abs=0.01)


def test_turns_a_long_prefill_lets_one_waiting_step_run_between_its_layers() -> None:
    """pdserve up's sharing: one forward at a time, waiting forwards in arrival order; a prefill of at
    least offer_min_tokens offers its turn every 1/layers of its work, and one waiting forward runs whole
    there before it goes on. (Arrivals off the 0.1 s grid: no two events at one instant.)"""
    p = _profile(sharing="turns", layers=10, offer_min_tokens=256)  # prefill 1 s, steps 0.1 s
    # A decodes (3 tokens: two steps) while B prefills: A's first step holds the turn when B arrives (to
    # 1.1); B then offers at 1.2, where A's second step runs (to 1.3), and goes on to 2.2.
    a, b = simulate(p, 1, 1, [Arrival(0.0, 300, 3), Arrival(1.05, 300, 3)])
    assert a.ttft == pytest.approx(1.0) and a.done == pytest.approx(1.3)
    assert b.ttft == pytest.approx(2.2 - 1.05) and b.done == pytest.approx(2.4)
    # Two decode workers stepping (C, D: 4 steps each) while E prefills: at each of E's offers one step
    # runs, C's and D's in turn: E is paused 6 times (1.3 ... 2.3), so its prefill ends at 2.8.
    c, d, e = simulate(p, 1, 2, [Arrival(0.0, 100, 5), Arrival(0.0, 100, 5), Arrival(1.05, 300, 2)])
    assert (c.ttft, d.ttft) == pytest.approx((1.0, 1.0))
    assert (c.done, d.done) == pytest.approx((2.2, 2.4))
    assert e.ttft == pytest.approx(2.8 - 1.05)
    # A short prompt (< offer_min_tokens) never offers: A's second step waits for B's whole forward.
    a, b = simulate(p, 1, 1, [Arrival(0.0, 100, 3), Arrival(1.05, 100, 3)])
    assert a.done == pytest.approx(2.2) and b.ttft == pytest.approx(2.1 - 1.05)
    # An efficiency below 1 slows every forward while two are active (from 1.05 on).
    p.shared_efficiency = 0.5
    a, b = simulate(p, 1, 1, [Arrival(0.0, 300, 3), Arrival(1.05, 300, 3)])
    assert a.done == pytest.approx(1.15 + 0.2 + 0.2)


def test_kv_room_admits_a_request_once_its_whole_answer_fits() -> None:
    """Room for 120 tokens, requests of 50 + 5: two decode together, the third waits for one to end;
    decode workers of their own profile (another TP size) step at their own speed."""
    p = _profile(prefill_s=(0.0, 0.999), decode_s=((0.1, 0.1), (0.8, 0.8)), kv_tokens=120)
    outs = simulate(p, 1, 1, [Arrival(0.0, 50, 5)] * 3)
    ttft = 0.001 * 149  # one forward over 3 x 50 tokens
    assert all(o.ttft == pytest.approx(ttft) for o in outs)
    # Two at batch 2 (0.2 s a step) for their 4 remaining tokens, then the third alone (0.1 s a step).
    assert [o.done for o in outs] == pytest.approx([ttft + 0.8, ttft + 0.8, ttft + 0.8 + 0.4])
    unlimited = simulate(_profile(prefill_s=(0.0, 0.999), decode_s=((0.1, 0.1), (0.8, 0.8))), 1, 1,
                         [Arrival(0.0, 50, 5)] * 3)  # fmt: skip
    assert all(o.done == pytest.approx(ttft + 4 * 0.3) for o in unlimited)
    # A request larger than the room alone still runs (the pool admits it alone).
    (big,) = simulate(p, 1, 1, [Arrival(0.0, 200, 3)])
    assert big.done == pytest.approx(0.199 + 2 * 0.1)
    fast = _profile(decode_s=((0.05, 0.05), (0.4, 0.4)))
    (o,) = simulate(_profile(prefill_s=(0.0, 0.999)), 1, 1, [Arrival(0.0, 11, 3)], decode_profile=fast)
    assert o.done == pytest.approx(0.01 + 2 * 0.05)


def test_a_cached_prefix_is_read_not_computed() -> None:
    """prefill(n, cached): linear between no prefix and the measured ones; the simulator prefills only the
    tokens after a request's cached prefix, at that cost."""
    p = _profile(prefill_s=(0.0, 0.999))  # prefill(n) = 0.001 (n - 1) without a prefix
    assert p.prefill(101, cached=500) == pytest.approx(0.1)  # no prefix measured: reading one is free
    p.prefix_tokens, p.prefix_s = [1000], [[0.05, 1.049]]  # after 1,000 cached: 0.05 + 0.001 (n - 1)
    assert p.prefill(1, cached=1000) == pytest.approx(0.05) and p.prefill(1000, 1000) == pytest.approx(1.049)
    # 101 new tokens: 0.1 with no prefix, 0.15 after 1,000 cached; after 500, halfway.
    assert p.prefill(101, cached=500) == pytest.approx(0.125)
    (o,) = simulate(p, 1, 1, [Arrival(0.0, 601, 1, cached=500)])
    assert o.ttft == pytest.approx(0.125)
    # In a batch, the prefix's extra is each request's own: one forward over 2 x 101 new tokens, + 0.025.
    outs = simulate(p, 1, 1, [Arrival(0.0, 601, 1, cached=500), Arrival(0.0, 101, 1)])
    assert [o.ttft for o in outs] == pytest.approx([0.201 + 0.025] * 2)
    # A workload's shared prefix: every prompt that much longer, that much of it cached.
    w = poisson_workload(1.0, 50, 100, 8, seed=1, cached=300)
    assert all(a.cached == 300 and 350 <= a.prompt <= 400 for a in w)
    p.prefix_s = [[0.05]]
    with pytest.raises(ValueError, match="prefix_s must be"):
        p.check()


def test_capacity_is_where_attainment_crosses_the_target() -> None:
    # 100% at 1/s, 80% at 2/s: 90% is crossed half way, at 1.5/s; the order of the points does not matter.
    assert capacity([(2.0, 0.8), (1.0, 1.0)], 0.9) == Capacity(pytest.approx(1.5))
    # A rate that met it again after one that missed is the noise of a short run, not capacity.
    assert capacity([(1.0, 0.95), (2.0, 0.5), (3.0, 0.92)], 0.9).rate == pytest.approx(1 + 0.05 / 0.45)
    # Met at every rate, or at none: bounds, printed as such.
    assert str(capacity([(1.0, 1.0), (2.0, 0.9)], 0.9)) == ">=2"
    assert str(capacity([(0.5, 0.3), (1.0, 0.1)], 0.9)) == "<0.5"
    with pytest.raises(ValueError):
        capacity([], 0.9)
