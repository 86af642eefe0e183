"""Turns at the CPU for the forwards of workers that share one host's cores.

A prefill and a decode worker on the same cores each run a team of OpenMP threads. Run at once, the two
teams oversubscribe the cores: a thread that waits at a barrier spins for a partner the other team has
preempted. Made to sleep instead (OMP_WAIT_POLICY=PASSIVE), every parallel region pays a wake-up. With
turns, one team computes at a time and each may spin briefly between its regions: before each forward a
worker takes an exclusive `flock` on a file that every co-located worker opens (`--cpu-forward-lock`),
and releases it after. The kernel drops the lock of a process that dies, so a crash never leaves the
others waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


class ForwardTurns:
    """An exclusive turn at the host's cores, shared through `flock` on `path`."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ValueError(f"--cpu-forward-lock {path}: cannot open it ({e.strerror})") from None

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


def forward_turns(path: str | None) -> ForwardTurns | None:
    return ForwardTurns(path) if path else None
