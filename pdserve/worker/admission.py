"""A GenerateRequest on its way into a worker: refused, held while its grammar compiles, or entered.

Both roles admit alike. A draining worker refuses (code `draining`); so does a request that cannot
fit the context or the KV pool, or whose grammar cannot be had (code `bad_request`). A request whose
grammar is not compiled yet waits outside the scheduler (`GrammarWaits`) and enters from `poll`;
every other one enters at once. Its matcher is fresh: on a prefill node it constrains the first
token sampled there; on a decode node it accepts the prefill's first token first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.protocol import gateway as m
from pdserve.protocol.vocabulary import FailCode
from pdserve.runtime.grammar import GrammarMatcher, GrammarWaits
from pdserve.runtime.runner import ModelRunner
from pdserve.worker.drain import DrainSignal

log = logging.getLogger(__name__)

Enter = Callable[[m.GenerateRequest, GrammarMatcher | None], None]
Fail = Callable[[str, FailCode, str], None]


class Admission:
    def __init__(
        self,
        role: str,
        runner: ModelRunner,
        signals: DrainSignal,
        clock: Callable[[], float],
        enter: Enter,
        fail: Fail,
        wake: Callable[[], None],
    ) -> None:
        """`enter(msg, grammar)` puts a request in the worker's scheduler; `fail(room, code, message)`
        refuses it; `wake` wakes a sleeping worker loop when a compile ends."""
        self.role, self.runner, self.signals = role, runner, signals
        self.enter, self.fail = enter, fail
        # Requests whose grammar compiles in the background: not entered until it is ready.
        self.compiling: GrammarWaits[m.GenerateRequest] = GrammarWaits(
            runner.spec.vocab_size, runner.cfg.grammar_compile_timeout_s, clock, wake=wake
        )

    def __len__(self) -> int:
        return len(self.compiling)

    def admit(self, msg: m.GenerateRequest) -> None:
        if msg.traceparent is not None:
            log.debug("room %s: traceparent %s", msg.room, msg.traceparent)
        if self.signals.draining.is_set():
            self.fail(msg.room, FailCode.DRAINING, f"the {self.role} worker is draining")
            return
        try:
            self.runner.check_fits(len(msg.input_ids), msg.sampling.max_new_tokens)
            compiling = self.runner.grammar_future(msg.sampling)
        except ValueError as e:
            self.fail(msg.room, FailCode.BAD_REQUEST, str(e))
            return
        constraint = msg.sampling.constraint
        if compiling is not None and constraint is not None:  # enters from `poll`
            self.compiling.add(msg.room, msg, constraint[0], compiling, msg.deadline_s)
            return
        self.enter(msg, None)

    def poll(self) -> None:
        """Requests whose grammar is ready enter; a failed or slow compile fails its own."""
        ready, failed = self.compiling.poll()
        for f in failed:
            self.fail(f.item.room, f.code, f.message)
        for msg, grammar in ready:
            self.enter(msg, grammar)

    def remove(self, room: str) -> None:
        """An aborted request that waits for its grammar leaves."""
        self.compiling.remove(room)
