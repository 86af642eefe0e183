"""Progress of long work: a tqdm bar on a terminal, plain log lines otherwise (logs, CI, pipes).

    for x in progress(items, total=len(items), desc="loading weights", say=log.info):
        ...

Off a terminal, a line is logged at the start, at every tenth of the way (at most one every 2 s)
and at the end, so a log file shows the work moving without a bar's carriage returns.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def stderr(line: str) -> None:
    """Progress lines of the benchmarks (their results go to stdout)."""
    print(line, file=sys.stderr, flush=True)


def on_terminal() -> bool:
    return sys.stderr.isatty()


Say = Callable[[str], None]


def progress(items: Iterable[T], total: int | None, desc: str, say: Say, unit: str = "it") -> Iterator[T]:
    if on_terminal():
        tqdm: Any = importlib.import_module("tqdm").tqdm
        yield from tqdm(items, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)
        return
    yield from _logged(items, total, desc, say, unit)


def _logged(items: Iterable[T], total: int | None, desc: str, say: Say, unit: str) -> Iterator[T]:
    start = last = time.monotonic()
    step = max(1, (total or 0) // 10)
    n = 0
    say(f"{desc}: started" + (f" ({total} {unit})" if total else ""))
    for x in items:
        yield x
        n += 1
        now = time.monotonic()
        if total and n < total and n % step == 0 and now - last >= 2.0:
            last = now
            say(f"{desc}: {n}/{total} {unit} ({now - start:.0f} s)")
    say(f"{desc}: done, {n} {unit} in {time.monotonic() - start:.1f} s")


class Counter:
    """A count moved by hand (e.g. requests completing out of order): `update()` after each."""

    def __init__(self, total: int, desc: str, say: Say, unit: str = "req") -> None:
        self.total, self.desc, self.say, self.unit = total, desc, say, unit
        self.n, self._start = 0, time.monotonic()
        self._last = self._start
        self._bar: Any = None
        if on_terminal():
            tqdm: Any = importlib.import_module("tqdm").tqdm
            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self._bar is not None:
            self._bar.update(k)
            return
        now = time.monotonic()
        step = max(1, self.total // 10)
        if self.n < self.total and self.n % step == 0 and now - self._last >= 2.0:
            self._last = now
            self.say(f"{self.desc}: {self.n}/{self.total} {self.unit} ({now - self._start:.0f} s)")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
