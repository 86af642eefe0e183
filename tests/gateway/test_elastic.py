"""The elastic controller's signals and decisions on hand-computed cases (gateway/autopilot/elastic.py). Its switches
of real workers under shifting traffic: tests/cluster/test_elastic_cluster.py."""

from __future__ import annotations

import time

import pytest

from pdserve.gateway.autopilot.elastic import ElasticController, measure, wanted
from pdserve.gateway.cluster.role_switch import Switch, SwitchRefused
from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.gateway.config import ElasticConfig
from pdserve.gateway.generation.request_trace import RequestTrace

from .test_control import _register

CFG = ElasticConfig(ttft_slo=1.0, tpot_slo=0.1, window_s=30, cooldown_s=10, confirm=2, min_samples=4)


def _registry(prefill: int, decode: int) -> WorkerRegistry:
    reg = WorkerRegistry()
    for role, n in (("prefill", prefill), ("decode", decode)):
        for i in range(n):
            reg.add(_register(f"{role}-{i}", role=role), f"{role}-{i}".encode(), time.monotonic())
    return reg


def _trace(ttft: float, seconds: float, tokens: int, ago: float = 1.0) -> RequestTrace:
    end = time.time() - ago
    meta = {"first_token_latency": ttft, "completion_tokens": tokens}
    return RequestTrace("r", end - seconds, end, "p", "d", {}, [], {}, meta, 10, 0)


def test_signals_are_the_window_s_misses_and_the_workers_load():
    reg = _registry(1, 2)
    reg.get("prefill-0").inflight_requests = 6
    reg.get("decode-0").running, reg.get("decode-1").running = 4, 2
    traces = [
        _trace(ttft=2.0, seconds=2.5, tokens=11),  # TTFT missed; TPOT 0.05: met
        _trace(ttft=0.5, seconds=2.5, tokens=11),  # TPOT (2.5 - 0.5) / 10 = 0.2: missed
        _trace(ttft=0.5, seconds=0.9, tokens=11),  # both met
        _trace(ttft=3.0, seconds=3.0, tokens=1),  # TTFT missed; one token: no TPOT
        _trace(ttft=9.0, seconds=9.0, tokens=2, ago=60),  # outside the 30 s window
    ]
    s = measure(reg, traces, since=0.0, cfg=CFG)
    assert (s.samples, s.ttft_miss, s.tpot_miss) == (4, 0.5, pytest.approx(1 / 3))
    assert (s.prefill_queue, s.decode_fill, s.prefill_workers, s.decode_workers) == (6.0, 0.375, 1, 2)
    # pressure: prefill max(0.5, 6 / 4) -> 1; decode max(1/3, 0.375 / 0.75) = 0.5
    assert s.pressure(CFG) == (1.0, 0.5)
    assert wanted(s, CFG) == "prefill"
    # begun before `since` (the split before the last switch): not counted
    assert measure(reg, traces, since=time.time(), cfg=CFG).samples == 0


def test_wanted_needs_pressure_a_margin_and_a_donor_above_the_minimum():
    reg = _registry(1, 1)
    reg.get("prefill-0").inflight_requests = 8
    s = measure(reg, [], 0.0, CFG)
    assert s.pressure(CFG) == (1.0, 0.0) and wanted(s, CFG) is None  # 1P1D: no decode to spare
    reg = _registry(2, 1)
    reg.get("decode-0").running = 8  # fill 1.0
    assert wanted(measure(reg, [], 0.0, CFG), CFG) == "decode"
    for w in reg.in_rotation("prefill"):
        w.inflight_requests = 4  # prefill pressure 1.0 too: within the margin, keep the split
    assert wanted(measure(reg, [], 0.0, CFG), CFG) is None


def test_the_controller_confirms_switches_the_least_loaded_donor_and_cools_down():
    reg = _registry(1, 2)
    reg.get("prefill-0").inflight_requests = 8
    reg.get("decode-0").inflight_requests, reg.get("decode-1").inflight_requests = 3, 1
    calls: list[tuple[str, str]] = []
    pending = [False]

    def switch(worker_id: str, role: str) -> Switch:
        calls.append((worker_id, role))
        return Switch(worker_id, "decode", role, 1)  # type: ignore[arg-type]

    c = ElasticController(CFG, reg, lambda: [], switch, lambda: pending[0])
    assert c.tick(now=100.0) is None  # the first check of a streak
    d = c.tick(now=101.0)
    assert d is not None and calls == [("decode-1", "prefill")] and d.outcome == "switching"
    assert "prefill pressure 1.00" in d.reason and "1P2D" in d.reason
    # While the switch is under way, nothing; after it, the cooldown holds the next one back.
    pending[0] = True
    assert c.tick(now=102.0) is None
    pending[0] = False
    assert c.tick(now=103.0) is None and c.tick(now=104.0) is None and len(calls) == 1
    assert c.tick(now=112.0) is not None and len(calls) == 2
    # A refused switch is kept as a decision with its reason.

    def refuse(worker_id: str, role: str) -> Switch:
        raise SwitchRefused(409, "a role switch is under way")

    c2 = ElasticController(CFG, reg, lambda: [], refuse, lambda: False)
    c2.tick(now=0.0)
    d2 = c2.tick(now=1.0)
    assert d2 is not None and d2.outcome == "refused: a role switch is under way"
    assert c2.view()["decisions"][0]["outcome"].startswith("refused")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="must be > 0"):
        ElasticConfig(interval_s=0)
    with pytest.raises(ValueError, match="--elastic-confirm"):
        ElasticConfig(confirm=0)
