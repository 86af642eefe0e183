"""A worker's drain flag, set by signals: the one thing the health port and the worker loop share;
and the deadlines of a drain under way."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

from pdserve.config import WorkerConfig


class DrainSignal:
    """SIGTERM/SIGINT set `draining`: stop taking new requests, finish running ones, then exit.

    A second signal exits at once (`stop`).
    """

    def __init__(self) -> None:
        self.draining = threading.Event()
        self.stop = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.draining.is_set():
            self.stop.set()
        self.draining.set()


@dataclass
class DrainDeadlines:
    """When a draining worker stops waiting for what it holds (time.monotonic() seconds)."""

    until: float  # the drain ends then, whatever is still held (--drain-timeout)
    # A role switch's (--switch-drain-timeout): past it, what is held is handed off, not waited for.
    hand_off_at: float | None = None
    handing_off: bool = False  # the hand-off began

    @classmethod
    def start(cls, cfg: WorkerConfig, switch: bool) -> DrainDeadlines:
        now = time.monotonic()
        return cls(now + cfg.drain_timeout_s, now + cfg.switch_drain_timeout_s if switch else None)

    def hand_off_due(self) -> bool:
        return self.hand_off_at is not None and time.monotonic() > self.hand_off_at

    def over(self) -> bool:
        return time.monotonic() > self.until
