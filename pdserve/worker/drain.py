"""A worker's drain flag, set by signals: the one thing the health port and the worker loop share."""

from __future__ import annotations

import signal
import threading


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
