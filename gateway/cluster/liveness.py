"""Liveness time: how long the gateway was in a position to hear a worker.

A worker is removed once it has sent nothing for `--heartbeat-timeout` (control.py). Counted in wall
time, that blames the workers for the gateway's own stalls. While the event loop is blocked (a long
computation on it, the GIL held by another thread, the process descheduled), the workers' Pongs pile
up unread in the control socket (zmq's I/O thread receives them without the GIL); when the loop
resumes, the heartbeat may run before the receive loop has read them. A /tokenize answer built on the
loop for 4.5 s once removed a healthy worker at the 5 s timeout this way.

`LivenessClock` counts only the time the loop was responsive. It advances with time.monotonic(), but
across one heartbeat tick by at most the interval plus a tolerance (`max_step_s`): the rest of a late
tick is the gateway's stall, not counted (and logged). Every liveness time is read on this clock: a
worker's last frame, the expiry check, the probe of an id another connection claims
(registration.py). So a worker is removed only after `heartbeat_timeout_s` of counted time in which
the heartbeat ran and nothing came from it; after a stall, the frames waiting in the socket are read
before the counted silence can reach the timeout (a stall adds at most one tick's worth).

A dead worker is still found however slow the loop: each tick counts up to `max_step_s`, so removal
takes at most timeout / max_step_s ticks (the timeout itself when the loop keeps its schedule).

The alternatives considered: reading the control socket on a thread of its own would not help (that
thread needs the GIL too, which the stalling thread may hold, and a zmq socket has one reader: every
token batch would then cross threads); draining the socket before expiring races with the receive
loop's own pending read. This clock needs neither another thread nor a second reader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A tick later than the interval by up to this much (or a quarter of the interval, if more) is the
# loop's ordinary jitter on a loaded machine, counted in full.
MIN_TOLERANCE_S = 0.1


class LivenessClock:
    """Seconds of responsive event loop, for liveness bookkeeping (module docstring). `tick` once per
    heartbeat interval, on the event loop; `now` anywhere on it."""

    def __init__(self, interval_s: float, mono: Callable[[], float] = time.monotonic) -> None:
        self.max_step_s = interval_s + max(interval_s / 4, MIN_TOLERANCE_S)
        self._mono = mono
        self._last = mono()
        self._counted = 0.0
        self.stalled_s = 0.0  # all the time not counted, for the logs

    def now(self) -> float:
        """The counted time so far: never decreasing, and never ahead of the next `tick`."""
        return self._counted + min(self._mono() - self._last, self.max_step_s)

    def tick(self) -> float:
        """Count the time since the last tick, at most `max_step_s`; returns the part not counted."""
        mono = self._mono()
        step, self._last = mono - self._last, mono
        counted = min(step, self.max_step_s)
        self._counted += counted
        stall = step - counted
        if stall > 0:
            self.stalled_s += stall
            if stall >= self.max_step_s:
                log.warning(
                    "the gateway's event loop did not run its heartbeat for %.1f s: that time is not "
                    "counted against the workers",
                    step,
                )
        return stall
