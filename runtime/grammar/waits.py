"""Where a worker's constrained requests wait while their grammar compiles, outside the scheduler.

A request with a constraint whose grammar is not cached yet is not queued for a forward: it waits
here, keyed by its room, while the worker loop keeps running everyone else. Its compile runs on the
backend's pool (backend.py); when it ends, the Future's callback wakes the loop (`wake`), and the
next `poll` hands the request over with its matcher to enter the scheduler. A compile that fails,
or is not done by its deadline (--grammar-compile-timeout), fails that request alone (code
`bad_request`); so does a request that passes its own deadline while waiting (code `deadline`). An
aborted request just leaves (`remove`).

A request whose grammar is cached enters in the same loop turn it arrived: `poll` runs right after
the turn's messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pdserve.protocol.vocabulary import FailCode
from pdserve.runtime.grammar.backend import CompileTimeout, InvalidGrammar
from pdserve.runtime.grammar.matcher import GrammarMatcher

T = TypeVar("T")


@dataclass(frozen=True)
class Failed(Generic[T]):
    """A waiting request that fails: `code` as in `RequestFailed` (bad_request or deadline)."""

    item: T
    code: FailCode
    message: str


@dataclass(frozen=True)
class _Wait(Generic[T]):
    item: T
    kind: str
    future: Future[Any]
    compile_deadline: float  # time.monotonic()
    deadline_s: float | None  # the request's own, on the worker's clock


class GrammarWaits(Generic[T]):
    """Requests (`item`, e.g. a GenerateRequest) waiting for their compiled grammar, by room."""

    def __init__(
        self,
        vocab_size: int,
        compile_timeout_s: float,
        clock: Callable[[], float],
        wake: Callable[[], None] | None = None,
    ):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.clock = clock  # the worker's clock, that request deadlines are on
        self.wake = wake
        self._waits: dict[str, _Wait[T]] = {}

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, room: object) -> bool:
        return room in self._waits

    def add(self, room: str, item: T, kind: str, future: Future[Any], deadline_s: float | None) -> None:
        due = time.monotonic() + self.compile_timeout_s
        self._waits[room] = _Wait(item, kind, future, due, deadline_s)
        if self.wake is not None and not future.done():
            wake = self.wake
            future.add_done_callback(lambda _: wake())

    def remove(self, room: str) -> T | None:
        w = self._waits.pop(room, None)
        return None if w is None else w.item

    def poll(self) -> tuple[list[tuple[T, GrammarMatcher]], list[Failed[T]]]:
        """The requests whose grammar is ready (with a fresh matcher each) and those that fail; both
        leave. The rest keep waiting."""
        ready: list[tuple[T, GrammarMatcher]] = []
        failed: list[Failed[T]] = []
        now, clock = time.monotonic(), self.clock()
        for room, w in list(self._waits.items()):
            if w.deadline_s is not None and clock > w.deadline_s:
                del self._waits[room]
                failed.append(
                    Failed(w.item, FailCode.DEADLINE, "the request passed its deadline (grammar compiling)")
                )
            elif w.future.done():
                del self._waits[room]
                try:
                    ready.append((w.item, GrammarMatcher(w.future.result(), self.vocab_size)))
                except InvalidGrammar as e:
                    failed.append(Failed(w.item, FailCode.BAD_REQUEST, str(e)))
                except Exception as e:  # cancelled by a closing backend
                    failed.append(Failed(w.item, FailCode.BAD_REQUEST, f"the {w.kind} constraint: {e!r}"))
            elif now > w.compile_deadline:
                del self._waits[room]
                timeout = CompileTimeout(w.kind, self.compile_timeout_s)
                failed.append(Failed(w.item, FailCode.BAD_REQUEST, str(timeout)))
        return ready, failed
