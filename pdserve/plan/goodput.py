"""What a simulated run is worth (simulate.py's outcomes): bench goodput's measures over its requests,
and DistServe's goodput, the highest rate whose attainment meets a target, over a sweep of rates."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.plan.simulate import Outcome


def goodput(outcomes: list[Outcome], ttft_slo: float, tpot_slo: float) -> dict[str, float]:
    """bench goodput's measures (benchmarks/bench_goodput.py) over a simulated run that starts at 0."""
    n = len(outcomes)
    duration = max((o.done for o in outcomes), default=0.0)
    ttft_ok = [o.ttft <= ttft_slo for o in outcomes]
    tpot_ok = [o.tpot <= tpot_slo for o in outcomes]
    good = sum(a and b for a, b in zip(ttft_ok, tpot_ok))
    return {
        "requests": n,
        "good": good,
        "duration_s": duration,
        "goodput": good / duration if duration > 0 else 0.0,
        "attainment": good / n if n else 0.0,
        "ttft_attainment": sum(ttft_ok) / n if n else 0.0,
        "tpot_attainment": sum(tpot_ok) / n if n else 0.0,
    }


@dataclass(frozen=True)
class Capacity:
    """DistServe's goodput: the highest request rate at which `target` of the requests meet both SLOs.
    `bound` is "" where the attainment crossed the target between two rates (linear between them), "<"
    where even the lowest rate missed it, ">=" where even the highest met it."""

    rate: float
    bound: str = ""

    def __str__(self) -> str:
        return f"{self.bound}{self.rate:.3g}"


def capacity(points: list[tuple[float, float]], target: float) -> Capacity:
    """From (rate, attainment) points: below the first rate to miss `target`, the rate where the line
    between it and the rate before (which met it) crosses the target. A rate that misses the target is
    not rescued by a higher one that met it again (the noise of a short run, not capacity)."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no rates to find a capacity in")
    prev: tuple[float, float] | None = None
    for rate, att in pts:
        if att < target:
            if prev is None:
                return Capacity(rate, "<")
            (r0, a0), (r1, a1) = prev, (rate, att)
            return Capacity(r0 + (r1 - r0) * (a0 - target) / (a0 - a1))
        prev = (rate, att)
    return Capacity(pts[-1][0], ">=")
