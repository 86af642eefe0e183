"""Turns at the CPU for the forwards of workers that share one host's cores.

A prefill and a decode worker on the same cores each run a team of OpenMP threads. Run at once, the two
teams oversubscribe the cores: a thread that waits at a barrier spins for a partner the other team has
preempted. Made to sleep instead (OMP_WAIT_POLICY=PASSIVE), every parallel region pays a wake-up. With
turns, one team computes at a time and each may spin briefly between its regions: before each forward a
worker takes an exclusive `flock` on a file that every co-located worker opens (`--cpu-forward-lock`),
and releases it after. The kernel drops the lock of a process that dies, so a crash never leaves the
others waiting.

A long forward (a prefill chunk of thousands of tokens takes seconds on a CPU) would hold every decode
step for its whole length, so it offers its turn between layers (`ForwardTurns.offer`): a worker that waits
holds a second lock, `PATH.next`, while it blocks on the first, and the holder that finds `.next` taken
lets it run one forward, then carries on. Waiters queue on `.next`, so none is passed over.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ValueError(f"--cpu-forward-lock {path}: cannot open it ({e.strerror})") from None


class ForwardTurns:
    """An exclusive turn at the host's cores, shared through `flock` on `path` (and `path + ".next"`)."""

    def __init__(self, path: str):
        self._turn = _open(path)
        self._next = _open(path + ".next")

    def _take(self) -> None:
        fcntl.flock(self._next, fcntl.LOCK_EX)  # in the queue: a holder sees someone waiting
        fcntl.flock(self._turn, fcntl.LOCK_EX)
        fcntl.flock(self._next, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def turn(self) -> Iterator[ForwardTurns]:
        """Hold the cores for one forward; the value's `offer()` lets a waiting worker go first."""
        self._take()
        try:
            yield self
        finally:
            fcntl.flock(self._turn, fcntl.LOCK_UN)

    def offer(self) -> bool:
        """(In a turn) If another worker waits for the cores, let it have one turn and take ours back
        after it; True if one did."""
        try:
            fcntl.flock(self._next, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a waiter holds `.next` while it blocks on the turn
            fcntl.flock(self._turn, fcntl.LOCK_UN)
            self._take()  # queued behind it: back once its forward is done
            return True
        fcntl.flock(self._next, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        os.close(self._turn)
        os.close(self._next)


def forward_turns(path: str | None) -> ForwardTurns | None:
    return ForwardTurns(path) if path else None
