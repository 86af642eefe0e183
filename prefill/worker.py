"""The prefill worker: batch prompts, compute their KV and first token, hand both to a decode node.

Loop: receive -> schedule -> run -> hand off -> reply (see `step`). A request's pages are held
until its KV transfer ends (Success or Failed), then freed.
"""

from __future__ import annotations

import logging
import os
import time

from pdserve import messages as m
from pdserve.config import WorkerConfig
from pdserve.drain import DrainSignal
from pdserve.kv_transfer import KVSender, TransferState
from pdserve.kv_transfer.config import config_for_pool
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.extend_scheduler import ExtendScheduler
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner, append_samples
from pdserve.worker_common import make_clock, register_factory, serve_until_drained
from pdserve.worker_link import WorkerLink

log = logging.getLogger(__name__)


STALL_ENV = "PDSERVE_TEST_STALL_KV_SEND_S"
# Test hook: each transfer is announced, then its data held back this long (TransferConfig.stall_data_s).
STALL_DATA_ENV = "PDSERVE_TEST_STALL_KV_DATA_S"


class PrefillWorker:
    def __init__(
        self, cfg: WorkerConfig, signals: DrainSignal | None = None, stall_kv_send_s: float | None = None
    ):
        """`stall_kv_send_s`: a test hook that holds each finished prefill this long before its KV is
        handed to the sender, as a stuck transfer path would (None: env PDSERVE_TEST_STALL_KV_SEND_S)."""
        self.cfg = cfg
        if stall_kv_send_s is None:
            stall_kv_send_s = float(os.environ.get(STALL_ENV, "0") or 0)
        self.stall_kv_send_s = stall_kv_send_s
        # Sends held back by the stall hook: (due time.monotonic(), room, pages, tokens, metadata).
        self.stalled: list[tuple[float, str, list[int], int, dict]] = []
        self.clock = make_clock(cfg)
        self.signals = signals or DrainSignal()
        self.runner = ModelRunner(cfg.runtime)
        rc = cfg.runtime
        self.sched = ExtendScheduler(
            self.runner,
            rc.chunked_prefill_size,
            rc.max_running_requests,
            reserve_tokens=lambda r: len(r.prompt_ids),
        )
        self.sender = KVSender(
            self.runner.pool.kv,
            self.runner.fingerprint(),
            cfg.host,
            cfg.bootstrap_port,
            config_for_pool(
                self.runner.pool.kv,
                cfg.kv_transfer_backend,
                waiting_timeout_s=cfg.kv_wait_timeout_s,
                transfer_timeout_s=cfg.transfer_timeout_s,
                stall_data_s=float(os.environ.get(STALL_DATA_ENV, "0") or 0),
            ),
        )
        self.rooms: dict[str, Request] = {}  # queued, prefilling or transferring
        self.events: dict[str, dict[str, float]] = {}
        self.link: WorkerLink | None = None

    def serve(self) -> None:
        self.sender.start()
        self.link = WorkerLink(
            self.cfg.gateway_addr,
            register_factory(self.cfg, self.runner, self.clock, self.sender.addr),
            self.clock,
        )
        self.link.start()
        self.link.wait_registered(self.cfg.register_timeout_s, cancel=self.signals.draining)
        log.info("prefill worker %s registered; KV bootstrap at %s", self.cfg.worker_id, self.sender.addr)
        try:
            serve_until_drained(self.cfg, self.link, self.signals, self.step, lambda: len(self.rooms))
        finally:
            self.sender.close()
            self.link.close()

    def step(self) -> None:
        assert self.link is not None
        # Block briefly only when no prompt waits: longer when nothing at all is in flight.
        wait = 0.0 if len(self.sched) else (0.005 if self.rooms else 0.05)
        for msg in self.link.recv(wait):
            self._on_message(msg)
        reqs, chunks = self.sched.schedule()
        if reqs:
            self._run(reqs, chunks)
        if self.stalled:
            self._release_stalled(time.monotonic())
        for res in self.sender.poll():
            self._on_transfer_end(res.room, res.state, res.error)
        ld = self.link.load
        ld.queued, ld.running = len(self.sched.waiting), len(self.rooms)
        ld.free_tokens = self.runner.allocator.num_free * self.runner.page_size

    def _on_message(self, msg) -> None:
        assert self.link is not None
        if isinstance(msg, m.GenerateRequest):
            self._admit(msg)
        elif isinstance(msg, m.AbortRequest):
            r = self.rooms.get(msg.room)
            if r is None:
                return
            if r in self.sched.waiting or r in self.sched.prefilling:
                self.sched.remove(r)
                self._forget(msg.room)
            elif any(x[1] == msg.room for x in self.stalled):
                self.stalled = [x for x in self.stalled if x[1] != msg.room]
                self.runner.release(r)
                self._forget(msg.room)
            else:
                self.sender.abort(msg.room)  # poll() reports Failed, then the pages are freed

    def _admit(self, req: m.GenerateRequest) -> None:
        assert self.link is not None
        if self.signals.draining.is_set():
            self._fail(req.room, "draining", "the prefill worker is draining")
            return
        try:
            self.runner.check_fits(len(req.input_ids), req.sampling.max_new_tokens)
        except ValueError as e:
            self._fail(req.room, "bad_request", str(e))
            return
        r = Request(req.room, req.input_ids, req.sampling, self.runner.spec.eos_token_ids)
        self.rooms[req.room] = r
        self.events[req.room] = {"queue_entry": self.clock()}
        self.sched.add(r)

    def _run(self, reqs: list[Request], chunks: list[list[int]]) -> None:
        assert self.link is not None
        now = self.clock()
        for r in reqs:
            self.events[r.rid].setdefault("forward_entry", now)
        logits = self.runner.forward(ForwardMode.EXTEND, reqs, chunks)
        done, rows = self.sched.take_completed(reqs)
        if not done:
            return
        append_samples(done, self.runner.sample(done, logits[rows]))
        now = self.clock()
        for r in done:
            ev = self.events.pop(r.rid)
            ev["prefill_finished"] = now
            meta = {
                "first_token": r.output_ids[0],
                "logprob": r.output_logprobs[0] if r.output_logprobs else None,
                "top_logprobs": r.output_top_logprobs[0] if r.output_top_logprobs else None,
                "cached_tokens": 0,
            }
            if self.stall_kv_send_s > 0:
                due = time.monotonic() + self.stall_kv_send_s
                self.stalled.append((due, r.rid, r.pages, len(r.prompt_ids), meta))
            else:
                self.sender.send(r.rid, r.pages, len(r.prompt_ids), meta)
            self.link.send(m.PrefillDone(room=r.rid, events=ev, cached_tokens=0))

    def _release_stalled(self, now: float) -> None:
        due = [x for x in self.stalled if x[0] <= now]
        self.stalled = [x for x in self.stalled if x[0] > now]
        for _, room, pages, tokens, meta in due:
            # An aborted room was remembered by the sender: this send fails at once and frees the pages.
            self.sender.send(room, pages, tokens, meta)

    def _on_transfer_end(self, room: str, state: TransferState, error: str | None) -> None:
        r = self.rooms.pop(room, None)
        if r is not None:
            self.runner.release(r)
        if state is TransferState.FAILED:
            log.warning("KV transfer of %s failed: %s", room, error)
            self._fail(room, "transfer", f"KV transfer failed: {error}")

    def _fail(self, room: str, code: str, message: str) -> None:
        assert self.link is not None
        self._forget(room)
        self.link.send(m.RequestFailed(room=room, role="prefill", code=code, message=message))

    def _forget(self, room: str) -> None:
        self.rooms.pop(room, None)
        self.events.pop(room, None)
