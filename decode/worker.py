"""The decode worker: pre-allocate pages, receive KV, and decode every running request together.

Loop: receive -> admit (pages first, then ask the prefill node for the KV) -> collect transfers ->
decode step -> reply with one TokenBatch carrying every request's new tokens (see `step`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from pdserve import messages as m
from pdserve.config import WorkerConfig
from pdserve.decode.stepper import make_stepper
from pdserve.kv_transfer import KVReceiver, TransferConfig, TransferState, default_backend
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner
from pdserve.worker_common import DrainSignal, make_clock, register_factory
from pdserve.worker_link import WorkerLink

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, cfg: WorkerConfig, signals: DrainSignal | None = None):
        self.cfg = cfg
        self.clock = make_clock(cfg)
        self.signals = signals or DrainSignal()
        self.runner = ModelRunner(cfg.runtime)
        self.stepper = make_stepper(self.runner)
        backend = cfg.kv_transfer_backend
        if backend == "auto":
            backend = default_backend(self.runner.pool.kv)
        self.receiver = KVReceiver(
            self.runner.pool.kv,
            self.runner.fingerprint(),
            TransferConfig(
                backend=backend,
                waiting_timeout_s=cfg.transfer_timeout_s,
                transfer_timeout_s=cfg.transfer_timeout_s,
            ),
        )
        self.pending: deque[tuple[Request, m.GenerateRequest]] = deque()  # waiting for pages
        self.transferring: dict[str, Request] = {}
        self.running: list[Request] = []
        self.events: dict[str, dict[str, float]] = {}
        self.link: WorkerLink | None = None

    @property
    def num_requests(self) -> int:
        return len(self.pending) + len(self.transferring) + len(self.running)

    def serve(self) -> None:
        self.receiver.start()
        self.link = WorkerLink(
            self.cfg.gateway_addr, register_factory(self.cfg, self.runner, self.clock), self.clock
        )
        self.link.start()
        self.link.wait_registered(self.cfg.register_timeout_s)
        log.info("decode worker %s registered", self.cfg.worker_id)
        drain_deadline = None
        try:
            while not self.signals.stop.is_set():
                if self.signals.draining.is_set() and drain_deadline is None:
                    drain_deadline = time.monotonic() + self.cfg.drain_timeout_s
                    self.link.load.draining = True
                    self.link.send(m.Deregister(worker_id=self.cfg.worker_id))
                    log.info("draining: %d requests left", self.num_requests)
                if drain_deadline is not None and (
                    not self.num_requests or time.monotonic() > drain_deadline
                ):
                    break
                self.step()
        finally:
            self.receiver.close()
            self.link.close()

    def step(self) -> None:
        assert self.link is not None
        wait = 0.0 if self.running else (0.005 if self.num_requests else 0.05)
        for msg in self.link.recv(wait):
            self._on_message(msg)
        self._admit()
        outputs: list[m.TokenOutput] = []
        for res in self.receiver.poll():
            out = self._on_transfer_end(res.room, res.state, res.metadata, res.error)
            if out is not None:
                outputs.append(out)
        if self.running:
            before = {r.rid: len(r.output_ids) for r in self.running}
            self.stepper.step(self.running)
            for r in self.running:
                outputs.append(self._output(r, r.output_ids[before[r.rid] :]))
        self._retire_finished()
        if outputs:
            self.link.send(m.TokenBatch(worker_id=self.cfg.worker_id, outputs=outputs))
        ld = self.link.load
        ld.queued, ld.running = len(self.pending) + len(self.transferring), len(self.running)
        ld.free_tokens = self.runner.allocator.num_free * self.runner.page_size

    def _on_message(self, msg) -> None:
        if isinstance(msg, m.GenerateRequest):
            if self.signals.draining.is_set():
                self._fail(msg.room, "draining", "the decode worker is draining")
                return
            try:
                self.runner.check_fits(len(msg.input_ids), msg.sampling.max_new_tokens)
            except ValueError as e:
                self._fail(msg.room, "bad_request", str(e))
                return
            r = Request(msg.room, msg.input_ids, msg.sampling, self.runner.spec.eos_token_ids)
            self.events[msg.room] = {"decode_entry": self.clock()}
            self.pending.append((r, msg))
        elif isinstance(msg, m.AbortRequest):
            self._abort(msg.room)

    def _admit(self) -> None:
        """Pre-allocate a request's whole lifetime, then ask its prefill node to fill the prompt pages."""
        while (
            self.pending
            and len(self.running) + len(self.transferring) < self.cfg.runtime.max_running_requests
        ):
            r, msg = self.pending[0]
            if not self.runner.reserve(r, r.max_total_tokens):
                break
            self.pending.popleft()
            self.transferring[r.rid] = r
            n = len(r.prompt_ids)
            self.receiver.request(r.rid, msg.prefill_bootstrap_addr, r.pages[: self.runner.pages_for(n)], n)

    def _on_transfer_end(
        self, room: str, state: TransferState, meta: dict | None, error: str | None
    ) -> m.TokenOutput | None:
        r = self.transferring.pop(room, None)
        if r is None:
            return None
        if state is not TransferState.SUCCESS or meta is None:
            self.runner.release(r)
            self.events.pop(room, None)
            self._fail(room, "transfer", f"KV transfer failed: {error}")
            return None
        r.num_computed = len(r.prompt_ids)
        top = meta.get("top_logprobs")
        r.append_token(meta["first_token"], meta.get("logprob"), [tuple(x) for x in top] if top else None)
        r.state = RequestState.RUNNING
        self.events[room]["kv_ready"] = self.clock()
        self.running.append(r)
        return self._output(r, r.output_ids[:1], first=True)

    def _output(self, r: Request, new: list[int], first: bool = False) -> m.TokenOutput:
        n = len(new)
        want_lp = r.params.logprobs or r.params.top_logprobs_num > 0
        out = m.TokenOutput(
            room=r.rid,
            token_ids=new,
            logprobs=r.output_logprobs[-n:] if want_lp and n and r.output_logprobs else None,
            top_logprobs=[list(t) for t in r.output_top_logprobs[-n:]]
            if r.params.top_logprobs_num and n
            else None,
            finished=r.finished,
            finish_reason=r.finish_reason,
        )
        if first:
            out.events = dict(self.events[r.rid])
        if r.finished:
            ev = self.events.pop(r.rid, {})
            ev["finished"] = self.clock()
            out.events = {**(out.events or {}), **ev}
            out.stats = {"cached_tokens": 0, "num_retractions": r.num_retractions, **self.stepper.stats(r)}
        return out

    def _retire_finished(self) -> None:
        for r in [r for r in self.running if r.finished]:
            self.running.remove(r)
            r.state = RequestState.FINISHED
            self.stepper.forget(r)
            self.runner.release(r)

    def _abort(self, room: str) -> None:
        for i, (r, _) in enumerate(self.pending):
            if r.rid == room:
                del self.pending[i]
                self.events.pop(room, None)
                return
        if room in self.transferring:
            self.receiver.abort(room)  # poll() reports Failed; the pages are freed there
            return
        for r in self.running:
            if r.rid == room:
                self.running.remove(r)
                self.stepper.forget(r)
                self.runner.release(r)
                self.events.pop(room, None)
                return

    def _fail(self, room: str, code: str, message: str) -> None:
        assert self.link is not None
        self.link.send(m.RequestFailed(room=room, role="decode", code=code, message=message))
