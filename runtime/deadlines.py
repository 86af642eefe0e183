"""Request deadlines on one node, checked once per scheduler step.

A deadline is absolute epoch seconds on the gateway's clock (`GenerateRequest.deadline_s`); a node
compares it with its own clock, so it is as exact as the two clocks agree (NTP), and the gateway's
own request timeout stays the backstop. The earliest deadline is cached: a step with nothing due
costs one comparison, whatever the number of requests.
"""

from __future__ import annotations

import math

from pdserve.runtime.request import Request


class Deadlines:
    def __init__(self) -> None:
        self._at: dict[str, tuple[float, Request]] = {}
        # A lower bound of every deadline held (it may be stale after `discard`: `due` then rescans).
        self._earliest = math.inf

    def __len__(self) -> int:
        return len(self._at)

    def add(self, req: Request, deadline: float | None) -> None:
        """Track `req` until `discard`; None: no deadline."""
        if deadline is None:
            return
        if not math.isfinite(deadline):
            raise ValueError(f"request {req.room}: deadline must be finite, got {deadline}")
        self._at[req.room] = (deadline, req)
        self._earliest = min(self._earliest, deadline)

    def discard(self, req: Request) -> None:
        self._at.pop(req.room, None)

    def due(self, now: float) -> list[Request]:
        """Requests whose deadline is at or before `now`, oldest deadline first; they stop being tracked."""
        if now < self._earliest:
            return []
        due = sorted((t, r.room, r) for t, r in self._at.values() if t <= now)
        for _, room, _ in due:
            del self._at[room]
        self._earliest = min((t for t, _ in self._at.values()), default=math.inf)
        return [r for _, _, r in due]
