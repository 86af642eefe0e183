"""The elastic controller (`--elastic`): moves one worker at a time between the prefill and decode tiers,
from what the gateway measures, so that the split follows the traffic.

Every `interval_s` it reads (`Signals`):
- over the requests finished in the last `window_s` and begun after the last switch (the old split's
  requests say nothing of the new one): the share whose TTFT missed `ttft_slo`, and the share whose TPOT
  (time per output token after the first) missed `tpot_slo`;
- the prefill queue: requests sent to the prefill workers in rotation and not prefilled yet, per worker;
- the decode batch fill: running requests over `max_running_requests`, mean over the decode workers.
Each tier's pressure is the larger of its misses and its load (prefill: queue / `queue_high`; decode:
fill / `fill_high`), at most 1. A tier under pressure (>= `pressure_high`) that is `margin` above the other
wins a worker from it, when `confirm` checks in a row agree, `cooldown_s` have passed since the last switch
began, no switch is under way, and the other tier keeps `min_per_role` workers. The worker that moves is
the other tier's least loaded. Every decision is logged with its numbers and kept (the last
`KEEP_DECISIONS`) for `/dashboard/data`; the switch itself is `POST /workers/{id}/role`'s
(gateway/cluster/role_switch.py), so it counts in `pdserve_role_switches_total`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.gateway.cluster.role_switch import Switch, SwitchRefused
from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.gateway.config import ElasticConfig
from pdserve.gateway.generation.request_trace import RequestTrace
from pdserve.protocol.gateway import Role

log = logging.getLogger(__name__)

KEEP_DECISIONS = 50


@dataclass(frozen=True)
class Signals:
    samples: int  # finished requests in the window
    ttft_miss: float  # shares of them, 0..1
    tpot_miss: float
    prefill_queue: float  # requests per prefill worker
    decode_fill: float  # 0..1
    prefill_workers: int
    decode_workers: int

    def pressure(self, cfg: ElasticConfig) -> tuple[float, float]:
        """(prefill, decode) pressure, each in 0..1."""
        counted = self.samples >= cfg.min_samples
        prefill = max(self.ttft_miss if counted else 0.0, self.prefill_queue / cfg.queue_high)
        decode = max(self.tpot_miss if counted else 0.0, self.decode_fill / cfg.fill_high)
        return min(1.0, prefill), min(1.0, decode)


def measure(
    registry: WorkerRegistry, finished: Iterable[RequestTrace], since: float, cfg: ElasticConfig
) -> Signals:
    """The signals now; `finished`'s requests count when they began at or after `since` (epoch s) and
    ended within the window."""
    now = time.time()
    ttft, tpot = [], []
    for t in finished:
        if t.start < since or t.end < now - cfg.window_s:
            continue
        first = t.meta_info.get("first_token_latency")
        if isinstance(first, (int, float)):
            ttft.append(first > cfg.ttft_slo)
            n = t.meta_info.get("completion_tokens")
            if isinstance(n, int) and n > 1:
                tpot.append((t.end - t.start - first) / (n - 1) > cfg.tpot_slo)
    prefills, decodes = registry.in_rotation("prefill"), registry.in_rotation("decode")
    return Signals(
        samples=len(ttft),
        ttft_miss=sum(ttft) / len(ttft) if ttft else 0.0,
        tpot_miss=sum(tpot) / len(tpot) if tpot else 0.0,
        prefill_queue=sum(w.inflight_requests for w in prefills) / len(prefills) if prefills else 0.0,
        decode_fill=(
            sum(w.running / max(1, w.reg.max_running_requests) for w in decodes) / len(decodes)
            if decodes
            else 0.0
        ),
        prefill_workers=len(prefills),
        decode_workers=len(decodes),
    )


def wanted(s: Signals, cfg: ElasticConfig) -> Role | None:
    """The tier that should win a worker now, by the signals alone (None: keep the split)."""
    p, d = s.pressure(cfg)
    if p >= cfg.pressure_high and p - d >= cfg.margin and s.decode_workers > cfg.min_per_role:
        return "prefill"
    if d >= cfg.pressure_high and d - p >= cfg.margin and s.prefill_workers > cfg.min_per_role:
        return "decode"
    return None


def donor(registry: WorkerRegistry, role: Role) -> WorkerInfo | None:
    """The least loaded worker in rotation that would leave `role`'s opposite for `role`."""
    other: Role = "decode" if role == "prefill" else "prefill"
    cands = registry.in_rotation(other)
    return min(cands, key=lambda w: (w.inflight_requests, w.running, w.worker_id)) if cands else None


@dataclass(frozen=True)
class Decision:
    at: float  # epoch seconds
    worker_id: str
    from_role: str
    to_role: str
    reason: str
    outcome: str  # "switching", or why the switch was refused


class ElasticController:
    def __init__(
        self,
        cfg: ElasticConfig,
        registry: WorkerRegistry,
        finished: Callable[[], Iterable[RequestTrace]],
        switch: Callable[[str, Role], Switch],
        pending: Callable[[], bool],
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self._finished = finished
        self._switch = switch
        self._pending = pending
        self.decisions: deque[Decision] = deque(maxlen=KEEP_DECISIONS)
        self._streak: tuple[Role | None, int] = (None, 0)
        self._last_switch = 0.0  # time.monotonic() of the last switch begun
        self._since = time.time()  # requests begun before this belong to the split before the last switch
        self.last: Signals | None = None

    def tick(self, now: float | None = None) -> Decision | None:
        """One check: the decision taken, if any."""
        now = time.monotonic() if now is None else now
        if self._pending():
            self._since = time.time()  # the switch is still moving: its requests are the old split's
            return None
        s = self.last = measure(self.registry, self._finished(), self._since, self.cfg)
        role = wanted(s, self.cfg)
        streak = self._streak[1] + 1 if role is not None and role == self._streak[0] else 1
        self._streak = (role, streak)
        if role is None or streak < self.cfg.confirm:
            return None
        if self._last_switch and now - self._last_switch < self.cfg.cooldown_s:
            return None
        w = donor(self.registry, role)
        if w is None:
            return None
        p, d = s.pressure(self.cfg)
        reason = (
            f"prefill pressure {p:.2f} (TTFT missed {s.ttft_miss:.0%}, queue {s.prefill_queue:.1f}/worker), "
            f"decode pressure {d:.2f} (TPOT missed {s.tpot_miss:.0%}, batch fill {s.decode_fill:.0%}), "
            f"{s.samples} requests, {s.prefill_workers}P{s.decode_workers}D"
        )
        try:
            self._switch(w.worker_id, role)
            outcome = "switching"
            self._last_switch = now
            self._since = time.time()
            self._streak = (None, 0)
        except SwitchRefused as e:
            outcome = f"refused: {e.message}"
        decision = Decision(time.time(), w.worker_id, w.role, role, reason, outcome)
        self.decisions.append(decision)
        log.info("elastic: %s %s -> %s: %s (%s)", w.worker_id, w.role, role, reason, outcome)
        return decision

    def view(self) -> dict[str, Any]:
        """For /dashboard/data: the targets, the last signals, and the decisions, newest first."""
        return {
            "ttft_slo": self.cfg.ttft_slo,
            "tpot_slo": self.cfg.tpot_slo,
            "signals": asdict(self.last) if self.last is not None else None,
            "decisions": [asdict(d) for d in reversed(self.decisions)],
        }

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                self.tick()
            except Exception:  # a bad check must not end the controller
                log.exception("elastic: a check failed")
