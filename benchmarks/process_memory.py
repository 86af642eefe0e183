"""How much memory a server holds: the PSS of its whole process tree, read from /proc (Linux).

PSS (proportional set size) charges each resident page to the processes that map it, split evenly
among them: a page shared by a prefill and a decode worker (the shared-memory KV segment, the Python
and torch libraries) counts half to each, so the sum over a server's processes counts it once. RSS
would count it once per process; the sum of PSS is what the server costs the machine.

`tree_pss_bytes(pid)` sums `Pss:` of /proc/PID/smaps_rollup over the process and every descendant
(`pdserve up` is a supervisor with a gateway and workers as children; `llama-server` is one process).
`MemorySampler` reads it for several servers on a background thread, keeping each one's peak.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from pdserve.procfs import kb_field_bytes

_PROC = "/proc"


def pss_bytes(pid: int) -> int | None:
    """PSS of one process in bytes; None where it cannot be read (gone, another user's, not Linux)."""
    return kb_field_bytes(f"{_PROC}/{pid}/smaps_rollup", "Pss")


def rss_bytes(pid: int) -> int | None:
    """RSS of one process in bytes (VmRSS of /proc/PID/status); None where it cannot be read."""
    return kb_field_bytes(f"{_PROC}/{pid}/status", "VmRSS")


def _parents() -> dict[int, int]:
    """Every visible process's parent, pid -> ppid, from /proc/PID/stat."""
    out = {}
    for name in os.listdir(_PROC):
        if not name.isdigit():
            continue
        try:
            with open(f"{_PROC}/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited while listed
        # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            out[int(name)] = int(fields[1])
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (children, their children...), `pid` first."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def tree_pss_bytes(pid: int) -> int:
    """The summed PSS in bytes of `pid` and all its descendants; processes that cannot be read (one
    that exits between the listing and the read) count 0."""
    return sum(pss_bytes(p) or 0 for p in process_tree(pid))


class MemorySampler:
    """Samples the tree PSS of named processes every `interval_s` on a daemon thread.

    `sample()` reads every tree now (and counts towards the peaks); `take_peaks()` returns each name's
    highest sample since the last `take_peaks()` (or the start) and starts a new window, so a caller
    brackets each benchmark run with it. A window without any background sample still holds the
    readings `take_peaks` itself takes at its start and end.
    """

    def __init__(self, pids: dict[str, int], interval_s: float = 0.5):
        self.pids = dict(pids)
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """The tree PSS in bytes of each name (all by default), read now; also raises the peaks."""
        now = {n: tree_pss_bytes(self.pids[n]) for n in (self.pids if names is None else names)}
        with self._lock:
            for n, v in now.items():
                self._peaks[n] = max(self._peaks.get(n, 0), v)
        return now

    def take_peaks(self) -> dict[str, int]:
        """Each name's peak PSS in bytes over the window that ends now; the next window starts."""
        self.sample()
        with self._lock:
            peaks, self._peaks = self._peaks, {}
        self.sample()  # the new window starts with a reading
        return peaks

    def start(self) -> MemorySampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
