"""The decode worker: pre-allocate pages, receive KV, and decode every running request together.
What both roles share (the link, the drain, messages, failure reports) is its shell, worker/shell.py.

Loop (`step`): receive -> schedule (resume retracted requests, admit: pages first, on top of the
prefix this node caches, then ask the prefill node for the KV of the pages after it, or compute the
prompt here for a local prefill; collect transfers; grow pages or retract) -> run one decode step ->
retire finished requests (their pages enter the prefix cache) -> reply with one TokenBatch
carrying every request's new tokens -> publish this step's cache events to the gateway.
Request sets, states and the page policy live in `scheduler.py`; this loop only asks it.
A request past its deadline (`GenerateRequest.deadline_s`, checked once per step) fails with code
`deadline` and its pages are freed, whatever its state (a transfer in flight is aborted first).
"""

from __future__ import annotations

import logging

from pdserve.config import WorkerConfig
from pdserve.decode.room import DecodeRoom
from pdserve.decode.scheduler import DecodeScheduler
from pdserve.decode.stepper import make_stepper
from pdserve.kv_transfer import KVReceiver, TransferResult, TransferState
from pdserve.kv_transfer.config import worker_transfer_config
from pdserve.protocol import gateway as m
from pdserve.protocol.records import DecodeEvents, PrefillEvents, RequestStats
from pdserve.protocol.vocabulary import FailCode
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.grammar import GrammarMatcher
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner, append_samples
from pdserve.worker.drain import DrainSignal
from pdserve.worker.kv_endpoints import receiver_for
from pdserve.worker.shell import WorkerShell
from pdserve.worker.step_faults import Progress
from pdserve.worker.test_hooks import TestHooks

log = logging.getLogger(__name__)


class DecodeWorker(WorkerShell):
    role = "decode"

    def __init__(
        self,
        cfg: WorkerConfig,
        signals: DrainSignal | None = None,
        runner: ModelRunner | None = None,
        hooks: TestHooks | None = None,
    ):
        super().__init__(cfg, signals, runner or ModelRunner(cfg.runtime), hooks)
        self.stepper = make_stepper(self.runner)
        rc = cfg.runtime
        lookahead = 1 + (rc.speculative_num_draft_tokens if rc.speculative_algorithm else 0)
        self.sched = DecodeScheduler(self.runner.pages, rc.max_running_requests, lookahead, self.cache)
        transfer_cfg = worker_transfer_config(cfg, self.runner.transfer_kv)
        self.receiver = receiver_for(self.runner, transfer_cfg)
        self.kv_backend = transfer_cfg.backend
        self.rooms: dict[str, DecodeRoom] = {}  # admitted until they leave

    @property
    def kv(self) -> KVReceiver:
        return self.receiver

    def serve(self) -> m.SwitchRole | None:
        if self.runner.compiled is not None:  # compile before taking requests, not at the first one
            self.runner.compiled.warm_up()
        return super().serve()

    def _held(self) -> int:
        return len(self.sched)

    def step(self) -> None:
        self._receive()
        if self._paused():
            return
        self._expire()
        # First tokens go out before the step that follows them (their TTFT does not wait for it).
        self._reply(self._schedule())
        outputs = self._run()
        self._retire_finished()
        self._reply(outputs)
        self._publish()

    def _receive(self) -> None:
        # Nothing running (or paused): sleep until a message or a transfer's end wakes the loop. A
        # request waiting for its KV needs no polling: the receiver wakes the loop when it lands (a
        # poll every few ms cost the prefill's forward on the same cores ~4 ms at 128 tokens).
        self._take_messages(bool(self.sched.running))

    def _schedule(self) -> list[m.TokenOutput]:
        """Resume, admit, collect finished transfers (their first tokens), then grow or retract."""
        s = self.sched
        for r in s.resume_retracted():
            try:
                self.runner.recompute([r])
            except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
                self.faults.lone(exc, r.room, "recomputing a retracted request")
                self._fail_internal(r.room, exc)
        local = []
        for r in s.admit():
            if r.state is RequestState.PREFILLING:
                local.append(r)
                continue
            # Only the pages after the prefix this node caches travel (the prefill node checks the hash).
            n = len(r.prompt_ids)
            skip, prefix_hash = s.skip(r)
            dst = r.pages[skip : s.pages.pages_for(n)]
            rec = self.rooms[r.room]
            self.receiver.request(r.room, rec.prefill_addr, dst, n, skip, prefix_hash)
            rec.kv_pages = dst
            rec.events["kv_requested"] = self.clock()
        outputs = self._prefill_locally(local)
        for res in self.receiver.poll():
            if res.prefix_mismatch and s.prefix_refused(res.room) is not None:
                log.warning("room %s: cached prefix refused, asking again in full: %s", res.room, res.error)
                continue
            try:
                out = self._on_transfer_end(res)
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
        bad = {r.room for r in self.faults.triage(exc, reqs, "a local prefill")}
        outputs, again = [], []
        for r in reqs:
            if r.room in bad:
                self._fail_internal(r.room, exc)
            elif progress[r.room].sampled(r):
                outputs.append(self._prefilled(r, start, self.clock()))
            else:
                progress[r.room].restore(r)
                again.append(r)
        return outputs + self._prefill_locally(again)

    def _prefilled(self, r: Request, start: float, now: float) -> m.TokenOutput:
        """A local prefill's request, first token sampled, joins the running batch."""
        rec = self.rooms[r.room]
        entry = rec.events.get("decode_entry", start)
        rec.events["kv_requested"] = start
        rec.prefill_events = PrefillEvents(queue_entry=entry, forward_entry=start, prefill_finished=now)
        rec.events["kv_ready"] = now
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
            bad = {r.room for r in self.faults.triage(exc, running, "a decode step")}
            for r in running:
                if r.room in bad:
                    self._fail_internal(r.room, exc)
                else:  # stepped again from where it was (a token it got before the failure stays)
                    before[r.room].restore(r)
            running = [r for r in running if r.room not in bad and before[r.room].sampled(r)]
        else:
            self.faults.ok()
        return [self._output(r, r.output_ids[before[r.room].outputs :]) for r in running]

    def _retire_finished(self) -> None:
        """Finished requests leave: their pages are freed (their prompt's cached), their stepper
        state dropped."""
        for r in self.sched.retire_finished():
            self.stepper.forget(r)
            self._forget(r.room)

    def _reply(self, outputs: list[m.TokenOutput]) -> None:
        assert self.link is not None
        if outputs:
            self.link.send(m.TokenBatch(worker_id=self.cfg.worker_id, outputs=outputs))
        s = self.sched
        ld = self.link.load
        ld.queued, ld.running = len(s) - len(s.running), len(s.running)
        ld.free_tokens = s.free_tokens

    def _abort(self, room: str) -> None:
        self._stop(room)

    def _enter(self, msg: m.GenerateRequest, grammar: GrammarMatcher | None) -> None:
        addr = "" if msg.local_prefill else msg.prefill_bootstrap_addr
        self.rooms[msg.room] = DecodeRoom(DecodeEvents(decode_entry=self.clock()), addr)
        r = Request(msg.room, msg.input_ids, msg.sampling, self.runner.spec.eos_token_ids, grammar=grammar)
        r.kv_cacheable = msg.use_prefix_cache  # False: no cached prefix read, none stored
        self.sched.add(r, msg.deadline_s, local_prefill=msg.local_prefill)

    def _expire(self) -> None:
        """Requests past their deadline fail: the gateway is told at once, the pages follow."""
        for r in self.sched.expire(self.clock()):
            state = r.state.value
            self._stop(r.room, r)
            msg = f"the request passed its deadline on decode worker {self.cfg.worker_id} ({state})"
            self._report(r.room, FailCode.DEADLINE, msg)

    def _on_transfer_end(self, res: TransferResult) -> m.TokenOutput | None:
        room, first, shm = res.room, res.metadata, res.shm
        rec = self.rooms.get(room)
        if rec is not None and rec.dropped:  # aborted or failed: dropped whatever the transfer did
            self.sched.kv_failed(room)
            self._forget(room)
            return None
        if res.state is not TransferState.SUCCESS or first is None:
            if self.sched.kv_failed(room) is not None:
                self._forget(room)
                if res.corrupt:
                    log.error("room %s: %s; failed, never decoded", room, res.error)
                    self._report(room, FailCode.KV_CORRUPT, f"KV transfer corrupt: {res.error}")
                else:
                    self._report(room, FailCode.TRANSFER, f"KV transfer failed: {res.error}")
            return None
        r = self.sched.kv_arrived(room)
        if r is None:
            return None
        if not shm:  # copied out of a same-host prefill: every rank's heads are in its pool already
            self.runner.after_receive(self.rooms[room].kv_pages)  # a TP worker's ranks take their heads
        r.append_token(first.first_token, first.logprob, first.top_logprobs or None)
        if first.weight_version != self.weights.version:
            r.kv_cacheable = False  # its prompt's KV is another version's
        rec = self.rooms[room]
        rec.events["kv_ready"] = self.clock()
        rec.transfer_bytes = res.num_bytes
        rec.kv_path = "shm" if shm else f"{self.kv_backend}/{'direct' if res.direct else 'staged'}"
        return self._output(r, r.output_ids[:1], first=True, version=first.weight_version)

    def _output(
        self, r: Request, new: list[int], first: bool = False, version: str | None = None
    ) -> m.TokenOutput:
        """`version`: the weights that produced `new` (default: this node's, which ran this step)."""
        logprobs, top_logprobs = r.newest_logprobs(len(new))
        out = m.TokenOutput(
            room=r.room,
            token_ids=new,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            finished=r.finished,
            finish_reason=r.finish_reason,
            weight_version=self.weights.version if version is None else version,
        )
        rec = self.rooms[r.room]
        if first:
            out.events = rec.events.copy()
            out.prefill_events, rec.prefill_events = rec.prefill_events, None
        if r.finished:
            rec.events["finished"] = self.clock()
            out.events = {**(out.events or {}), **rec.events}
            out.stats = RequestStats(
                cached_tokens=0,
                num_retractions=r.num_retractions,
                kv_path=rec.kv_path,
                transfer_bytes=rec.transfer_bytes,
                decode_cached_tokens=r.cached_tokens,
                deterministic=self.runner.loaded.batch_invariant,
                **self.stepper.stats(r),
            )
        return out

    def _fail_internal(self, room: str, exc: BaseException) -> None:
        """`room` fails with code `internal` through the abort path: its pages are freed, never cached."""
        self._stop(room)
        self._report(room, FailCode.INTERNAL, self.faults.message(exc))

    def _fail_every(self, code: FailCode, message: str) -> None:
        for r in self.sched.live():
            rec = self.rooms.get(r.room)
            if rec is None or not rec.dropped:  # a dropped one was reported when its transfer was stopped
                self._stop(r.room)
                self._report(r.room, code, message)

    def _weights_changed(self) -> None:
        """A weight update committed: the KV of every request here may mix versions; never cache it."""
        for r in self.sched.live():
            r.kv_cacheable = False

    def _stop(self, room: str, left: Request | None = None) -> None:
        """`room` leaves (aborted or failed). With its transfer in flight, the transfer is aborted and
        the room dropped when poll() reports its end, whatever that is (a shared-memory copy may be
        done already): no second report. Else its pages are freed now. `left`: its request, when the
        scheduler let it go already (`expire`)."""
        if self.sched.is_transferring(room):
            if (rec := self.rooms.get(room)) is not None:
                rec.dropped = True
            self.receiver.abort(room)
            return
        removed = self.sched.remove(room) or left
        if removed is not None:
            self.stepper.forget(removed)
        self._forget(room)

    def _forget(self, room: str) -> None:
        self.rooms.pop(room, None)
