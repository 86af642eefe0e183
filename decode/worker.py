"""The decode worker: pre-allocate pages, receive KV, and decode every running request together.

Loop (`step`): receive -> schedule (resume retracted requests, admit: pages first, on top of the
prefix this node caches, then ask the prefill node for the KV of the pages after it, or compute the
prompt here for a local prefill; collect transfers; grow pages or retract) -> run one decode step ->
hand off (retire finished requests: their pages enter the prefix cache) -> reply with one TokenBatch
carrying every request's new tokens -> publish this step's cache events to the gateway.
Request sets, states and the page policy live in `scheduler.py`; this loop only asks it.
A request past its deadline (`GenerateRequest.deadline_s`, checked once per step) fails with code
`deadline` and its pages are freed, whatever its state (a transfer in flight is aborted first).
"""

from __future__ import annotations

import logging

from pdserve.config import WorkerConfig
from pdserve.decode.scheduler import DecodeScheduler
from pdserve.decode.stepper import make_stepper
from pdserve.kv_transfer import KVReceiver, TransferState
from pdserve.kv_transfer.config import worker_transfer_config
from pdserve.protocol import gateway as m
from pdserve.protocol.kv_trailer import FirstToken
from pdserve.protocol.records import DecodeEvents, PrefillEvents, RequestStats
from pdserve.protocol.vocabulary import FailCode
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.grammar import GrammarMatcher, GrammarWaits
from pdserve.runtime.radix_cache import RadixCache
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner, append_samples
from pdserve.runtime.weight_update import WeightUpdater
from pdserve.worker.cache_events import CacheEvents
from pdserve.worker.common import loop_wait, make_clock, register_factory, serve_until_drained
from pdserve.worker.drain import DrainSignal
from pdserve.worker.link import WorkerLink
from pdserve.worker.step_faults import Progress, StepFaults

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, cfg: WorkerConfig, signals: DrainSignal | None = None):
        self.cfg = cfg
        self.clock = make_clock(cfg)
        self.signals = signals or DrainSignal()
        self.runner = ModelRunner(cfg.runtime)
        self.stepper = make_stepper(self.runner)
        rc = cfg.runtime
        lookahead = 1 + (rc.speculative_num_draft_tokens if rc.speculative_algorithm else 0)
        cache = None
        if not rc.disable_radix_cache:
            cache = RadixCache(self.runner.allocator, rc.page_size, record_events=True)
        self.sched = DecodeScheduler(self.runner.pages, rc.max_running_requests, lookahead, cache)
        self.cache_events = CacheEvents(cfg.worker_id, "decode", cache)
        transfer_cfg = worker_transfer_config(cfg, self.runner.pool.kv)
        self.receiver = KVReceiver(self.runner.pool.kv, self.runner.fingerprint(), transfer_cfg)
        self.receiver.on_result = self._transfer_ended  # a waiting loop wakes for the first token
        self.kv_backend = transfer_cfg.backend
        self.prefill_addr: dict[str, str] = {}  # room -> its prefill node's bootstrap address
        self.events: dict[str, DecodeEvents] = {}
        self.prefill_events: dict[str, PrefillEvents] = {}  # local prefills', until the first output
        self.transfer_bytes: dict[str, int] = {}  # KV bytes each transfer moved, until the final output
        self.transfer_path: dict[str, str] = {}  # how: "gloo/direct", "nccl/staged"... (RequestStats.kv_path)
        # Rooms aborted, or failed for their deadline, whose transfer is being stopped: dropped at its end.
        self.expired: set[str] = set()
        self.link: WorkerLink | None = None
        self.weights = WeightUpdater.for_runner(self.runner, cache, cfg.host, self._weights_changed)
        # An exception in one request's work fails that request (code internal), not the worker.
        self.faults = StepFaults(cfg.worker_id, "decode", self.runner.spec.vocab_size)
        # Requests whose grammar compiles in the background: not admitted until it is ready.
        self.compiling: GrammarWaits[m.GenerateRequest] = GrammarWaits(
            self.runner.spec.vocab_size,
            rc.grammar_compile_timeout_s,
            self.clock,
            wake=self._transfer_ended,  # link.wake(): a compile's end wakes a sleeping loop
        )

    def serve(self) -> None:
        if self.runner.compiled is not None:  # compile before taking requests, not at the first one
            self.runner.compiled.warm_up()
        self.receiver.start()
        self.link = WorkerLink(
            self.cfg.gateway_addr,
            register_factory(self.cfg, self.runner, self.clock, None, lambda: self.weights.version),
            self.clock,
            keys=self.cfg.keys,
        )
        self.link.start()
        self.link.wait_registered(self.cfg.register_timeout_s, cancel=self.signals.draining)
        log.info("decode worker %s registered", self.cfg.worker_id)
        try:
            serve_until_drained(
                self.cfg,
                self.link,
                self.signals,
                self.step,
                lambda: len(self.sched) + len(self.compiling),
                self.receiver.io_failure,
            )
        finally:
            self.weights.close()
            self.receiver.close()
            self.link.close()

    def _transfer_ended(self) -> None:
        if self.link is not None:
            self.link.wake()

    def step(self) -> None:
        self._receive()
        assert self.link is not None
        for reply in self.weights.poll():
            self.link.send(reply)
        if self.weights.paused:  # /pause_generation: no forward until resumed
            self.cache_events.publish(self.link)
            return
        self._expire()
        # First tokens go out before the step that follows them (their TTFT does not wait for it).
        self._reply(self._schedule())
        outputs = self._run()
        self._hand_off()
        self._reply(outputs)
        assert self.link is not None
        self.cache_events.publish(self.link)

    def _receive(self) -> None:
        assert self.link is not None
        s = self.sched
        # Nothing running (or paused): sleep until a message or a transfer's end wakes the loop. A
        # request waiting for its KV needs no polling: the receiver wakes the loop when it lands (a
        # poll every few ms cost the prefill's forward on the same cores ~4 ms at 128 tokens).
        for msg in self.link.recv(loop_wait(bool(s.running), self.weights)):
            self._on_message_guarded(msg)
        self._admit_compiled()

    def _schedule(self) -> list[m.TokenOutput]:
        """Resume, admit, collect finished transfers (their first tokens), then grow or retract."""
        s = self.sched
        for r in s.resume_retracted():
            try:
                self.runner.recompute([r])
            except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
                self.faults.lone(exc, r.rid, "recomputing a retracted request")
                self._fail_internal(r.rid, exc)
        local = []
        for r in s.admit():
            if r.state is RequestState.PREFILLING:
                local.append(r)
                continue
            # Only the pages after the prefix this node caches travel (the prefill node checks the hash).
            n = len(r.prompt_ids)
            skip, prefix_hash = s.skip(r)
            dst = r.pages[skip : s.pages.pages_for(n)]
            self.receiver.request(r.rid, self.prefill_addr[r.rid], dst, n, skip, prefix_hash)
            self.events[r.rid]["kv_requested"] = self.clock()
        outputs = self._prefill_locally(local)
        for res in self.receiver.poll():
            if res.prefix_mismatch and s.prefix_refused(res.room) is not None:
                log.warning("room %s: cached prefix refused, asking again in full: %s", res.room, res.error)
                continue
            try:
                out = self._on_transfer_end(
                    res.room, res.state, res.metadata, res.error, res.num_bytes, res.direct, res.shm
                )
            except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
                self.faults.lone(exc, res.room, "taking a request's first token")
                self._fail_internal(res.room, exc)
                continue
            if out is not None:
                outputs.append(out)
        # Retracted requests keep their stepper state (speculative counters, drafter indexes):
        # they resume where they stopped.
        s.grow_or_retract()
        return outputs

    def _prefill_locally(self, reqs: list[Request]) -> list[m.TokenOutput]:
        """Conditional disaggregation: compute these prompts here (from their cached prefix on) in one
        extend forward and sample their first tokens, as a prefill node would; no KV travels."""
        if not reqs:
            return []
        start = self.clock()
        progress = Progress.of(reqs)
        try:
            logits = self.runner.forward(
                ForwardMode.EXTEND, reqs, [r.prompt_ids[r.num_computed :] for r in reqs]
            )
            append_samples(reqs, self.runner.sample(reqs, logits))
        except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
            return self._local_prefill_failed(reqs, progress, exc, start)
        self.faults.ok()
        now = self.clock()
        return [self._prefilled(r, start, now) for r in reqs]

    def _local_prefill_failed(
        self, reqs: list[Request], progress: dict[str, Progress], exc: Exception, start: float
    ) -> list[m.TokenOutput]:
        """The culprits fail; those that got their first token go on; the rest run again without
        the culprits (a second failure, with no culprit left to find, fails them all)."""
        bad = {r.rid for r in self.faults.triage(exc, reqs, "a local prefill")}
        outputs, again = [], []
        for r in reqs:
            if r.rid in bad:
                self._fail_internal(r.rid, exc)
            elif progress[r.rid].sampled(r):
                outputs.append(self._prefilled(r, start, self.clock()))
            else:
                progress[r.rid].restore(r)
                again.append(r)
        return outputs + self._prefill_locally(again)

    def _prefilled(self, r: Request, start: float, now: float) -> m.TokenOutput:
        """A local prefill's request, first token sampled, joins the running batch."""
        entry = self.events[r.rid].get("decode_entry", start)
        self.events[r.rid]["kv_requested"] = start
        self.prefill_events[r.rid] = PrefillEvents(
            queue_entry=entry, forward_entry=start, prefill_finished=now
        )
        self.events[r.rid]["kv_ready"] = now
        self.sched.prefilled(r)
        return self._output(r, r.output_ids[:1], first=True)

    def _run(self) -> list[m.TokenOutput]:
        # A request whose first token already finished it is not stepped again.
        running = [r for r in self.sched.running if not r.finished]
        if not running:
            return []
        before = Progress.of(running)
        try:
            self.stepper.step(running)
        except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
            bad = {r.rid for r in self.faults.triage(exc, running, "a decode step")}
            for r in running:
                if r.rid in bad:
                    self._fail_internal(r.rid, exc)
                else:  # stepped again from where it was (a token it got before the failure stays)
                    before[r.rid].restore(r)
            running = [r for r in running if r.rid not in bad and before[r.rid].sampled(r)]
        else:
            self.faults.ok()
        return [self._output(r, r.output_ids[before[r.rid].outputs :]) for r in running]

    def _hand_off(self) -> None:
        """Finished requests leave: their pages are freed, their stepper state dropped."""
        for r in self.sched.retire_finished():
            self.stepper.forget(r)
            self.prefill_addr.pop(r.rid, None)

    def _reply(self, outputs: list[m.TokenOutput]) -> None:
        assert self.link is not None
        if outputs:
            self.link.send(m.TokenBatch(worker_id=self.cfg.worker_id, outputs=outputs))
        s = self.sched
        ld = self.link.load
        ld.queued, ld.running = len(s) - len(s.running), len(s.running)
        ld.free_tokens = s.free_tokens

    def _on_message_guarded(self, msg: m.Message) -> None:
        """`_on_message`; an exception while admitting a request fails that request alone."""
        try:
            self._on_message(msg)
        except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
            if not isinstance(msg, m.GenerateRequest):
                log.error("handling a %s message failed", msg.kind, exc_info=exc)
                return
            self.faults.lone(exc, msg.room, "admitting a request")
            self._fail_internal(msg.room, exc)

    def _on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.GenerateRequest):
            if msg.traceparent is not None:
                log.debug("room %s: traceparent %s", msg.room, msg.traceparent)
            if self.signals.draining.is_set():
                self._fail(msg.room, FailCode.DRAINING, "the decode worker is draining")
                return
            try:
                self.runner.check_fits(len(msg.input_ids), msg.sampling.max_new_tokens)
                # Its matcher accepts the prefill's first token first (`_on_transfer_end`).
                compiling = self.runner.grammar_future(msg.sampling)
            except ValueError as e:
                self._fail(msg.room, FailCode.BAD_REQUEST, str(e))
                return
            constraint = msg.sampling.constraint
            if compiling is not None and constraint is not None:  # enters from `_admit_compiled`
                self.compiling.add(msg.room, msg, constraint[0], compiling, msg.deadline_s)
                return
            self._enter(msg, None)
        elif isinstance(msg, m.WeightsCommand):
            assert self.link is not None
            reply = self.weights.on_command(msg)
            if reply is not None:
                self.link.send(reply)
        elif isinstance(msg, m.FlushCache):
            assert self.link is not None
            self.link.send(self.cache_events.flush(msg.flush_id, len(self.sched)))
        elif isinstance(msg, m.AbortRequest):
            self.compiling.remove(msg.room)
            if self.sched.is_transferring(msg.room):
                # The transfer may still end well (a shared-memory copy already done): whatever poll()
                # reports, the room is dropped there and its pages freed, never run.
                self.expired.add(msg.room)
                self.receiver.abort(msg.room)
                return
            removed = self.sched.remove(msg.room)
            if removed is not None:
                self.stepper.forget(removed)
            self._forget(msg.room)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready are admitted; a failed or slow compile fails its own."""
        ready, failed = self.compiling.poll()
        for f in failed:
            self._fail(f.item.room, f.code, f.message)
        for msg, grammar in ready:
            self._enter(msg, grammar)

    def _enter(self, msg: m.GenerateRequest, grammar: GrammarMatcher | None) -> None:
        self.events[msg.room] = DecodeEvents(decode_entry=self.clock())
        if not msg.local_prefill:
            self.prefill_addr[msg.room] = msg.prefill_bootstrap_addr
        r = Request(msg.room, msg.input_ids, msg.sampling, self.runner.spec.eos_token_ids, grammar=grammar)
        self.sched.add(r, msg.deadline_s, local_prefill=msg.local_prefill)

    def _expire(self) -> None:
        """Requests past their deadline fail: the gateway is told at once, the pages follow."""
        for r in self.sched.expire(self.clock()):
            state = r.state.value
            if r.state is RequestState.TRANSFERRING:
                self.expired.add(r.rid)
                self.receiver.abort(r.rid)  # poll() reports it; `_on_transfer_end` frees the pages
            else:
                self.stepper.forget(r)
                self._forget(r.rid)
            msg = f"the request passed its deadline on decode worker {self.cfg.worker_id} ({state})"
            self._fail(r.rid, FailCode.DEADLINE, msg)

    def _on_transfer_end(
        self,
        room: str,
        state: TransferState,
        first: FirstToken | None,
        error: str | None,
        num_bytes: int,
        direct: bool = False,
        shm: bool = False,
    ) -> m.TokenOutput | None:
        if room in self.expired:  # aborted, or failed for its deadline: dropped whatever the transfer did
            self.expired.discard(room)
            self.sched.kv_failed(room)
            self._forget(room)
            return None
        if state is not TransferState.SUCCESS or first is None:
            if self.sched.kv_failed(room) is not None:
                self._forget(room)
                self._fail(room, FailCode.TRANSFER, f"KV transfer failed: {error}")
            return None
        r = self.sched.kv_arrived(room)
        if r is None:
            return None
        r.append_token(first.first_token, first.logprob, first.top_logprobs or None)
        if first.weight_version != self.weights.version:
            r.kv_cacheable = False  # its prompt's KV is another version's
        self.events[room]["kv_ready"] = self.clock()
        self.transfer_bytes[room] = num_bytes
        self.transfer_path[room] = "shm" if shm else f"{self.kv_backend}/{'direct' if direct else 'staged'}"
        return self._output(r, r.output_ids[:1], first=True, version=first.weight_version)

    def _output(
        self, r: Request, new: list[int], first: bool = False, version: str | None = None
    ) -> m.TokenOutput:
        """`version`: the weights that produced `new` (default: this node's, which ran this step)."""
        logprobs, top_logprobs = r.newest_logprobs(len(new))
        out = m.TokenOutput(
            room=r.rid,
            token_ids=new,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            finished=r.finished,
            finish_reason=r.finish_reason,
            weight_version=self.weights.version if version is None else version,
        )
        if first:
            out.events = self.events[r.rid].copy()
            out.prefill_events = self.prefill_events.pop(r.rid, None)
        if r.finished:
            ev = self.events.pop(r.rid, {})
            ev["finished"] = self.clock()
            out.events = {**(out.events or {}), **ev}
            out.stats = RequestStats(
                cached_tokens=0,
                num_retractions=r.num_retractions,
                kv_path=self.transfer_path.pop(r.rid, "local"),
                transfer_bytes=self.transfer_bytes.pop(r.rid, 0),
                decode_cached_tokens=r.cached_tokens,
                **self.stepper.stats(r),
            )
        return out

    def _fail_internal(self, room: str, exc: BaseException) -> None:
        """`room` fails with code `internal` through the abort path: its pages are freed, never cached."""
        if self.sched.is_transferring(room):
            self.expired.add(room)  # its transfer's end needs no second report
            self.receiver.abort(room)
        else:
            removed = self.sched.remove(room)
            if removed is not None:
                self.stepper.forget(removed)
            self._forget(room)
        self._fail(room, FailCode.INTERNAL, self.faults.message(exc))

    def _fail(self, room: str, code: FailCode, message: str) -> None:
        assert self.link is not None
        self.link.send(m.RequestFailed(room=room, role="decode", code=code, message=message))

    def _weights_changed(self) -> None:
        """A weight update committed: the KV of every request here may mix versions; never cache it."""
        for r in self.sched.live():
            r.kv_cacheable = False

    def _forget(self, room: str) -> None:
        self.events.pop(room, None)
        self.prefill_addr.pop(room, None)
        self.prefill_events.pop(room, None)
        self.transfer_bytes.pop(room, None)
        self.transfer_path.pop(room, None)
