"""The shell both worker roles run in: what a prefill and a decode worker do alike around their step.

`WorkerShell` owns the worker's life: its clock, drain signals, prefix cache and its events, weight
updates, step-fault triage and admission; its KV endpoint (the role's sender or receiver), started
before registering and closed after the drain; the control link to the gateway; and the serve loop
(`serve_until_drained`: the health port, the drain, a role switch). It dispatches the gateway's
messages alike for both roles. A role (prefill/worker.py, decode/worker.py) keeps only its own logic:
`step` (receive -> schedule -> run -> hand off -> reply) and the hooks below it names.

The method names mean the same in both roles:
  `_report(room, code, message)`  tell the gateway `room` failed here (nothing else changes);
  `_fail_internal(room, exc)`     `room` fails with code `internal` through the abort path;
  `_stop`                         `room` leaves this node: its pages freed now, or when its transfer ends;
  `_forget(room)`                 drop the role's record of `room`;
  `_on_transfer_end(result)`      a KV transfer's end, as the endpoint's poll reports it;
  `_wake()`                       end the loop's current wait (a transfer ended, a grammar compiled).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Protocol

from pdserve.config import WorkerConfig
from pdserve.protocol import gateway as m
from pdserve.protocol.vocabulary import FailCode
from pdserve.runtime.grammar import GrammarMatcher
from pdserve.runtime.radix_cache import RadixCache
from pdserve.runtime.runner import ModelRunner
from pdserve.runtime.weight_update import WeightUpdater
from pdserve.worker.admission import Admission
from pdserve.worker.cache_events import CacheEvents
from pdserve.worker.common import (
    accept_switch,
    connect_link,
    loop_wait,
    paused_for_weights,
    serve_until_drained,
)
from pdserve.worker.drain import DrainSignal
from pdserve.worker.link import WorkerLink
from pdserve.worker.step_faults import StepFaults
from pdserve.worker.test_hooks import TestHooks, worker_clock


class KVEndpoint(Protocol):
    """What the shell needs of a role's KV sender or receiver: its life and its health."""

    on_result: Callable[[], None] | None

    def start(self) -> None: ...

    def close(self) -> None: ...

    def io_failure(self) -> str | None: ...


class WorkerShell(ABC):
    role: ClassVar[m.Role]

    def __init__(
        self, cfg: WorkerConfig, signals: DrainSignal | None, runner: ModelRunner, hooks: TestHooks | None
    ) -> None:
        """`runner`: the role's model (a role switch hands the last role's on); `hooks`: the test
        hooks set (None: none, as in serving)."""
        self.cfg = cfg
        self.hooks = hooks
        self.clock = worker_clock(hooks)
        self.signals = signals or DrainSignal()
        self.runner = runner
        self.switch: m.SwitchRole | None = None  # taken from the gateway: drain, then serve that role
        self.link: WorkerLink | None = None  # connected by `serve`
        rc = cfg.runtime
        self.cache: RadixCache | None = None
        if not rc.disable_radix_cache:
            self.cache = RadixCache(runner.allocator, rc.page_size, record_events=True)
        self.cache_events = CacheEvents(cfg.worker_id, self.role, self.cache)
        self.weights = WeightUpdater.for_runner(runner, self.cache, cfg.host, self._weights_changed)
        # An exception in one request's work fails that request (code internal), not the worker.
        self.faults = StepFaults(cfg.worker_id, self.role, runner.spec.vocab_size)
        self.admission = Admission(
            self.role, runner, self.signals, self.clock, self._enter, self._report, self._wake
        )

    # ---- what a role provides ------------------------------------------------------------------

    @property
    @abstractmethod
    def kv(self) -> KVEndpoint:
        """The role's KV endpoint (built, not started)."""

    @abstractmethod
    def step(self) -> None:
        """One turn of the worker loop."""

    @abstractmethod
    def _held(self) -> int:
        """Requests the role holds (admitted, not yet left)."""

    @abstractmethod
    def _enter(self, msg: m.GenerateRequest, grammar: GrammarMatcher | None) -> None:
        """An admitted request enters the role's scheduler."""

    @abstractmethod
    def _abort(self, room: str) -> None:
        """The gateway aborted `room` (it may not be held here)."""

    @abstractmethod
    def _fail_internal(self, room: str, exc: BaseException) -> None: ...

    @abstractmethod
    def _fail_every(self, code: FailCode, message: str) -> None:
        """Every request held here fails with `code` (each reported once)."""

    @abstractmethod
    def _weights_changed(self) -> None:
        """A weight update committed."""

    def _bootstrap_addr(self) -> str | None:
        """Where decode nodes reach this worker's KV (registered with the gateway), if they do."""
        return None

    # ---- the shell ----------------------------------------------------------------------------

    def serve(self) -> m.SwitchRole | None:
        """Serve until drained; the switch taken, if that is why (the caller closes the runner)."""
        kv = self.kv
        kv.on_result = self._wake  # a sleeping loop wakes to free pages or take a first token
        kv.start()
        addr = self._bootstrap_addr()
        link_type = WorkerLink if self.hooks is None else self.hooks.link_type(self.runner.spec.vocab_size)
        self.link = connect_link(
            self.cfg, self.runner, self.clock, self.signals, self.weights, addr, link_type
        )
        log = logging.getLogger(f"pdserve.{self.role}.worker")
        where = f"; KV bootstrap at {addr}" if addr else ""
        log.info("%s worker %s registered%s", self.role, self.cfg.worker_id, where)
        try:
            serve_until_drained(
                self.cfg,
                self.link,
                self.signals,
                self.step,
                lambda: self._held() + len(self.admission),
                lambda: kv.io_failure() or self.runner.tp_failure(),
                lambda: self.switch is not None,
                self._hand_off_held,
            )
        finally:
            self.weights.close()
            kv.close()
            self.link.close()
        return self.switch if not self.signals.draining.is_set() else None

    def _take_messages(self, can_compute: bool) -> None:
        """The gateway's messages, handled (waiting for the first one unless `can_compute`); then the
        requests whose grammar got compiled enter."""
        assert self.link is not None
        for msg in self.link.recv(loop_wait(can_compute, self.weights)):
            self.faults.guard_message(self._on_message, msg, self._fail_internal)
        self.admission.poll()

    def _paused(self) -> bool:
        """The step's weight-update part; True while generation is paused (the step ends there)."""
        assert self.link is not None
        return paused_for_weights(self.link, self.weights, self.cache_events)

    def _publish(self) -> None:
        """This step's prefix-cache events go to the gateway."""
        assert self.link is not None
        self.cache_events.publish(self.link)

    def _on_message(self, msg: m.Message) -> None:
        assert self.link is not None
        if isinstance(msg, m.GenerateRequest):
            self.admission.admit(msg)
        elif isinstance(msg, m.AbortRequest):
            self.admission.remove(msg.room)
            self._abort(msg.room)
        elif isinstance(msg, m.WeightsCommand):
            reply = self.weights.on_command(msg)
            if reply is not None:
                self.link.send(reply)
        elif isinstance(msg, m.SwitchRole):
            self.switch = accept_switch(self.cfg, msg, self.switch)
        elif isinstance(msg, m.FlushCache):
            self.link.send(self.cache_events.flush(msg.flush_id, self._held()))

    def _hand_off_held(self) -> None:
        """A role switch's drain deadline passed: every request held here fails with code `draining`,
        which the gateway runs again or migrates to another worker (its pages are freed now, or when
        its transfer ends)."""
        to = self.switch.role if self.switch is not None else "another role"
        why = (
            f"the {self.role} worker {self.cfg.worker_id} is switching to {to} and its drain deadline "
            f"({self.cfg.switch_drain_timeout_s:g} s) passed: the request goes on elsewhere"
        )
        self._fail_every(FailCode.DRAINING, why)

    def _report(self, room: str, code: FailCode, message: str) -> None:
        assert self.link is not None
        self.link.send(m.RequestFailed(room=room, role=self.role, code=code, message=message))

    def _wake(self) -> None:
        if self.link is not None:
            self.link.wake()
