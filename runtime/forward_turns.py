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

A turn has a deadline. A holder that is stopped (SIGSTOP, a debugger) or wedged keeps its lock, which the
kernel frees only when the process dies, so without a bound it would hold every forward of its neighbour
until it resumes. A worker that has waited `wait_bound_s()` (by default max(MIN_WAIT_S, WAIT_FACTOR x its
slowest recent forward), at most MAX_WAIT_S) runs its forward anyway and warns who holds the turn: each
holder writes its pid and worker id at the start of the lock file, and the waiter reads the pid that
holds the lock from /proc/locks and the process's state from /proc/PID/stat (T: stopped). Until the
turn comes back (an episode, `stall`) its forwards run without waiting; one warning per episode, at
most one every WARN_EVERY_S. flock has no timeout, so the blocking wait runs on a helper thread and the
forward's thread waits for it with one.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import fcntl
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIN_WAIT_S = 2.0  # the shortest bound: above a worker's scheduling hiccups and a short prefill forward
WAIT_FACTOR = 4.0  # x the slowest of this worker's recent forwards
MAX_WAIT_S = 10.0  # the longest derived bound (a long forward offers its turn between layers anyway)
RECENT_FORWARDS = 16  # forwards whose durations set the derived bound
WARN_EVERY_S = 30.0  # at most one warning about an overdue turn per this many seconds
RECORD_BYTES = 128  # "pid worker-id", space-padded, at the start of the lock file


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ValueError(f"--cpu-forward-lock {path}: cannot open it ({e.strerror})") from None


def _worker_id(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--worker-id" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--worker-id="):
            return arg.split("=", 1)[1]
    return None


@dataclass(frozen=True)
class TurnHolder:
    """The process that held the turn when a wait ran out."""

    pid: int
    name: str  # its --worker-id, else its command's first words
    stopped: bool  # state T or t in /proc/PID/stat: it cannot run, nor release the turn, until SIGCONT

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name}){', which is STOPPED' if self.stopped else ''}"


def _process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "gone"
    return _worker_id(argv) or " ".join(argv[:3])[:80] or "?"


def _lock_holders(fd: int) -> list[int]:
    """Pids holding a flock on the file open as `fd`, from /proc/locks (empty where unreadable)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line has "->" after the index
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == inode:
                    pids.append(int(parts[4]))
    except (OSError, ValueError):
        return []
    return pids


def _holder(turn_fd: int, next_fd: int) -> TurnHolder | None:
    """Who holds the turn (else `.next`), by /proc/locks; named by the record it wrote in the lock file."""
    me = os.getpid()
    try:
        record = os.pread(turn_fd, RECORD_BYTES, 0).decode(errors="replace").split(maxsplit=1)
        recorded = (int(record[0]), record[1].strip()) if len(record) == 2 else None
    except (OSError, ValueError):
        recorded = None
    pids = [p for p in _lock_holders(turn_fd) + _lock_holders(next_fd) if p != me]
    if not pids:  # no /proc/locks: trust the record of the last holder
        if recorded is None or recorded[0] == me:
            return None
        pids = [recorded[0]]
    pid = pids[0]
    name = recorded[1] if recorded is not None and recorded[0] == pid else _process_name(pid)
    return TurnHolder(pid, name, _process_state(pid) in ("T", "t"))


@dataclass
class TurnStall:
    """An episode: this worker's forwards run without the turn until it comes back."""

    since: float  # time.monotonic() when the overdue wait began
    holder: TurnHolder | None
    skipped: int = 0  # waits given up meanwhile


class _State(enum.Enum):
    IDLE = "idle"  # not held, no wait in flight
    PENDING = "pending"  # the helper thread blocks in flock for this worker
    HELD = "held"


class ForwardTurns:
    """An exclusive turn at the host's cores, shared through `flock` on `path` (and `path + ".next"`).

    `wait_bound_s`: how long a forward waits for the turn before it runs anyway (None: derived)."""

    def __init__(self, path: str, wait_bound_s: float | None = None, name: str | None = None):
        self._turn = _open(path)
        self._next = _open(path + ".next")
        self._fixed_bound = wait_bound_s
        self._durations: collections.deque[float] = collections.deque(maxlen=RECENT_FORWARDS)
        label = name or _worker_id(sys.argv) or "worker"
        self._record = f"{os.getpid()} {label}".encode()[:RECORD_BYTES].ljust(RECORD_BYTES)
        self._cond = threading.Condition()
        self._state = _State.IDLE
        self._active = False  # a forward runs, with or without the turn
        self._closed = False
        self._waited = 0.0  # seconds the current forward spent waiting (its offers included)
        self.stall: TurnStall | None = None
        self._last_warning = -WARN_EVERY_S
        self._unwarned = 0  # episodes not warned about since the last warning
        self._helper = threading.Thread(target=self._wait_loop, name="cpu-turn-wait", daemon=True)
        self._helper.start()

    def wait_bound_s(self) -> float:
        if self._fixed_bound is not None:
            return self._fixed_bound
        return min(MAX_WAIT_S, max(MIN_WAIT_S, WAIT_FACTOR * max(self._durations, default=0.0)))

    # ---- the lock ------------------------------------------------------------------------------------

    def _try_take(self) -> bool:
        """(IDLE, under the condition) Take a free turn at once, unless a waiter is queued on `.next`."""
        try:
            fcntl.flock(self._next, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            fcntl.flock(self._turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            fcntl.flock(self._next, fcntl.LOCK_UN)

    def _wait_loop(self) -> None:
        """The helper thread: blocks in flock (queued on `.next`) whenever a wait is PENDING."""
        while True:
            with self._cond:
                while self._state is not _State.PENDING and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            fcntl.flock(self._next, fcntl.LOCK_EX)  # in the queue: a holder sees someone waiting
            fcntl.flock(self._turn, fcntl.LOCK_EX)
            fcntl.flock(self._next, fcntl.LOCK_UN)
            with self._cond:
                if self._closed:
                    os.close(self._turn)  # close() left the files to this thread, blocked in flock then
                    os.close(self._next)
                    return
                if self._active:
                    self._state = _State.HELD
                    os.pwrite(self._turn, self._record, 0)
                else:  # the forward that wanted it ran without it and is done
                    fcntl.flock(self._turn, fcntl.LOCK_UN)
                    self._state = _State.IDLE
                stall, self.stall = self.stall, None
                self._cond.notify_all()
            if stall is not None:
                log.warning(
                    "the CPU turn came back after %.1f s (%d waits given up meanwhile)",
                    time.monotonic() - stall.since,
                    stall.skipped,
                )

    def _acquire(self) -> None:
        """Take the turn, or give up after the bound (or at once during an episode) and run without it."""
        start = time.monotonic()
        with self._cond:
            if self._state is _State.IDLE:
                if self._try_take():
                    self._state = _State.HELD
                    os.pwrite(self._turn, self._record, 0)
                    return
                self._state = _State.PENDING
                self._cond.notify_all()
            bound = 0.0 if self.stall is not None else self.wait_bound_s()
            deadline = start + bound
            while self._state is _State.PENDING and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            self._waited += time.monotonic() - start
            if self._state is _State.HELD:
                return
            stall = self.stall
            if stall is not None:
                stall.skipped += 1
                return
        self._overdue(start, bound)

    def _overdue(self, start: float, bound: float) -> None:
        holder = _holder(self._turn, self._next)  # /proc reads: outside the condition
        with self._cond:
            if self._state is not _State.PENDING:
                return  # the turn came back meanwhile
            self.stall = TurnStall(start, holder, skipped=1)
        now = time.monotonic()
        if now - self._last_warning < WARN_EVERY_S:
            self._unwarned += 1
            return
        more = f" ({self._unwarned} earlier episodes not logged)" if self._unwarned else ""
        self._last_warning, self._unwarned = now, 0
        log.warning(
            "waited %.1f s for the CPU turn (bound %.1f s), held by %s: running without it until it "
            "comes back%s",
            now - start,
            bound,
            holder or "an unknown process",
            more,
        )

    # ---- turns -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self) -> Iterator[ForwardTurns]:
        """Hold the cores for one forward (or run without them past the bound); the value's `offer()`
        lets a waiting worker go first."""
        with self._cond:
            self._active = True
            self._waited = 0.0
        start = time.monotonic()
        self._acquire()
        try:
            yield self
        finally:
            with self._cond:
                self._active = False
                if self._state is _State.HELD:
                    fcntl.flock(self._turn, fcntl.LOCK_UN)
                    self._state = _State.IDLE
                self._durations.append(time.monotonic() - start - self._waited)

    def offer(self) -> bool:
        """(In a turn) If another worker waits for the cores, let it have one turn and take ours back
        after it; True if one did."""
        with self._cond:
            if self._state is not _State.HELD:
                return False  # running without the turn (the helper holds `.next`): nothing to offer
            try:
                fcntl.flock(self._next, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a waiter holds `.next` while it blocks on the turn
                fcntl.flock(self._turn, fcntl.LOCK_UN)
                self._state = _State.IDLE
            else:
                fcntl.flock(self._next, fcntl.LOCK_UN)
                return False
        self._acquire()  # queued behind it: back once its forward is done
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if self._state is _State.PENDING:
                return  # the helper blocks in flock on these files: it closes them when it returns
        os.close(self._turn)
        os.close(self._next)


def forward_turns(path: str | None) -> ForwardTurns | None:
    return ForwardTurns(path) if path else None
