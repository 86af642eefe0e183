"""Clock-offset estimation between the gateway and one worker (NTP's four timestamps).

offset = worker clock - gateway clock, so a worker time `t_w` maps to the gateway clock as
`t_w - offset`. Among recent samples the one with the smallest round trip is kept: its error is
bounded by rtt / 2, and a large rtt means the sample was delayed on one side.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class OffsetSample:
    offset: float
    rtt: float


def ntp_sample(t0: float, t1: float, t2: float, t3: float) -> OffsetSample:
    """t0: gateway send, t1: worker receive, t2: worker send, t3: gateway receive."""
    return OffsetSample(offset=((t1 - t0) + (t2 - t3)) / 2.0, rtt=max(0.0, (t3 - t0) - (t2 - t1)))


class OffsetEstimator:
    def __init__(self, window: int = 16) -> None:
        self._samples: deque[OffsetSample] = deque(maxlen=window)
        # One-way sample (Register.t_send): used only until a round trip arrives.
        self._weak: OffsetSample | None = None

    def add_one_way(self, t_worker_send: float, t_gateway_recv: float) -> None:
        # The message's transit time is unknown, so the sample's error is unbounded: rtt = inf.
        self._weak = OffsetSample(offset=t_worker_send - t_gateway_recv, rtt=math.inf)

    def add_round_trip(self, t0: float, t1: float, t2: float, t3: float) -> OffsetSample:
        s = ntp_sample(t0, t1, t2, t3)
        self._samples.append(s)
        return s

    def best(self) -> OffsetSample | None:
        if self._samples:
            return min(self._samples, key=lambda s: s.rtt)
        return self._weak

    @property
    def offset(self) -> float:
        """The current estimate; 0.0 (same clock) before any sample."""
        b = self.best()
        return b.offset if b is not None else 0.0

    @property
    def rtt(self) -> float | None:
        """Round trip of the sample behind `offset` (its error is at most rtt / 2); None before one."""
        b = self.best()
        return b.rtt if b is not None and b.rtt != math.inf else None

    def to_gateway(self, t_worker: float) -> float:
        return t_worker - self.offset
