"""The prefill worker: batch prompts, compute their KV and first token, hand both to a decode node.
What both roles share (the link, the drain, messages, failure reports) is its shell, worker/shell.py.

Loop: receive -> schedule -> run -> reply -> hand off (see `step`). A request's pages are held
until its KV transfer ends (Success or Failed); then its whole prompt pages go into the prefix cache
(unless --disable-radix-cache), where later prompts that start the same way find them, and the rest
is freed. Its state (queued, prefilling, transferring, then finished or failed) is moved only by
the ExtendScheduler, which owns the pages.
A request past its deadline (`GenerateRequest.deadline_s`, checked once per step) fails with code
`deadline`: queued or prefilling at once, transferring by stopping its transfer.
"""

from __future__ import annotations

import logging

import torch

from pdserve.config import WorkerConfig
from pdserve.kv_transfer import KVSender, TransferResult, TransferState
from pdserve.kv_transfer.config import worker_transfer_config
from pdserve.prefill.room import PrefillRoom
from pdserve.protocol import gateway as m
from pdserve.protocol.block_hash import block_hashes
from pdserve.protocol.kv_trailer import FirstToken
from pdserve.protocol.records import PrefillEvents
from pdserve.protocol.vocabulary import FailCode
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.extend_scheduler import ExtendScheduler
from pdserve.runtime.grammar import GrammarMatcher
from pdserve.runtime.prompt_logprobs import take_prompt_logprobs
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.request_state import TERMINAL
from pdserve.runtime.runner import ModelRunner, sample_first_tokens
from pdserve.worker.drain import DrainSignal
from pdserve.worker.kv_endpoints import sender_for
from pdserve.worker.shell import WorkerShell
from pdserve.worker.step_faults import Progress
from pdserve.worker.test_hooks import TestHooks

log = logging.getLogger(__name__)


class PrefillWorker(WorkerShell):
    role = "prefill"

    def __init__(
        self,
        cfg: WorkerConfig,
        signals: DrainSignal | None = None,
        runner: ModelRunner | None = None,
        hooks: TestHooks | None = None,
    ):
        super().__init__(cfg, signals, runner or ModelRunner(cfg.runtime), hooks)
        rc = cfg.runtime
        # Prompt pages enter the prefix cache when their KV transfer ends (`retire`), not before:
        # until then they are the request's.
        self.sched = ExtendScheduler(
            self.runner.pages,
            rc.chunked_prefill_size,
            rc.max_running_requests,
            reserve_tokens=lambda r: len(r.prompt_ids),
            cache=self.cache,
        )
        transfer_cfg = worker_transfer_config(cfg, self.runner.transfer_kv)
        self.sender = sender_for(self.runner, cfg.host, cfg.bootstrap_port, transfer_cfg, hooks)
        self.rooms: dict[str, PrefillRoom] = {}  # queued, prefilling or transferring
        self.blocked = False  # the last schedule() gave nothing to run

    @property
    def kv(self) -> KVSender:
        return self.sender

    def _bootstrap_addr(self) -> str | None:
        return self.sender.addr

    def _held(self) -> int:
        return len(self.rooms)

    def step(self) -> None:
        self._receive()
        if self._paused():
            return
        self._expire()
        reqs, chunks = self.sched.schedule()
        self.blocked = not reqs  # prompts wait for pages (or none wait): a transfer's end wakes the loop
        done = self._run(reqs, chunks) if reqs else []
        self._reply(done)  # first: PrefillDone carries the first token, which the client may be waiting for
        self._hand_off(done)
        self._publish()

    def _receive(self) -> None:
        """Ended transfers (their pages are freed), then the gateway's messages."""
        ended = self.sender.poll()
        for res in ended:
            self._on_transfer_end(res)
        if ended:
            self.blocked = False  # pages came back: waiting prompts may fit now
        # No prompt it can compute (or paused): sleep until a message or a transfer's end wakes the loop.
        self._take_messages(len(self.sched) > 0 and not self.blocked)

    def _abort(self, room: str) -> None:
        rec = self.rooms.get(room)
        if rec is not None:
            self._stop(rec.request)

    def _stop(self, r: Request) -> bool:
        """End `r` on this node: its pages are freed now (False), or, with its transfer in flight,
        once the sender reports that transfer Failed (True; `_on_transfer_end`)."""
        if r.state is RequestState.TRANSFERRING:
            self.sender.abort(r.room)
            return True
        if r.state not in TERMINAL:
            self.sched.retire(r, RequestState.FAILED)
        self._forget(r.room)
        return False

    def _expire(self) -> None:
        """Requests past their deadline fail: the gateway is told at once, the pages follow."""
        for r in self.sched.expire(self.clock()):
            msg = f"the request passed its deadline on prefill worker {self.cfg.worker_id} ({r.state.value})"
            self._fail_held(r, FailCode.DEADLINE, msg)

    def _enter(self, req: m.GenerateRequest, grammar: GrammarMatcher | None) -> None:
        r = Request(req.room, req.input_ids, req.sampling, self.runner.spec.eos_token_ids, grammar=grammar)
        r.kv_cacheable = req.use_prefix_cache  # False: no cached prefix read, none stored
        events = PrefillEvents(queue_entry=self.clock())
        self.rooms[req.room] = PrefillRoom(r, events, alone=not req.decode_worker)
        self.sched.add(r, req.deadline_s)

    def _run(self, reqs: list[Request], chunks: list[list[int]]) -> list[Request]:
        """One extend forward; returns the requests whose prompt it completed, first token sampled."""
        now = self.clock()
        for r in reqs:
            self.rooms[r.room].events.setdefault("forward_entry", now)
        progress = Progress.of(reqs)
        try:
            logits = self._forward(reqs, chunks)
        except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
            bad = {r.room for r in self.faults.triage(exc, reqs, "a prefill forward")}
            for r in reqs:
                if r.room in bad:
                    self._fail_internal(r.room, exc)
                else:  # scheduled again from where it was
                    progress[r.room].restore(r)
            return []
        done, rows = self.sched.take_completed(reqs)
        if done:
            done = self._sample(done, logits[rows], progress)
        self.faults.ok()
        end = self.clock()
        for r in reqs:
            if (rec := self.rooms.get(r.room)) is not None:  # one whose first token failed has left
                rec.chunks.append((now, end))
        for r in done:
            self.rooms[r.room].events["prefill_finished"] = end
        return done

    def _forward(self, reqs: list[Request], chunks: list[list[int]]) -> torch.Tensor:
        """One extend forward: each request's last row of logits (prompt logprobs recorded on the way)."""
        if any(r.params.logprob_start_len >= 0 for r in reqs):  # prompt logprobs: every row's logits
            before = [r.num_computed for r in reqs]
            logits = self.runner.forward(ForwardMode.EXTEND, reqs, chunks, all_logits=True)
            return take_prompt_logprobs(reqs, before, chunks, logits)
        return self.runner.forward(ForwardMode.EXTEND, reqs, chunks)

    def _sample(
        self, done: list[Request], logits: torch.Tensor, progress: dict[str, Progress]
    ) -> list[Request]:
        """The first tokens of `done` (logits: their rows). When the batch's sampling raises, each
        request is sampled alone and those that raise alone fail; the others go on."""
        try:
            sample_first_tokens(self.runner, done, logits)
            return done
        except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
            log.warning(
                "sampling %d first tokens failed (%s): sampling each alone", len(done), type(exc).__name__
            )
        kept = []
        for i, r in enumerate(done):
            try:
                if not progress[r.room].sampled(r):
                    sample_first_tokens(self.runner, [r], logits[i : i + 1])
                kept.append(r)
            except Exception as exc:  # noqa: BLE001
                self.faults.lone(exc, r.room, "sampling the first token")
                self._fail_internal(r.room, exc)
        return kept

    def _hand_off(self, done: list[Request]) -> None:
        """Completed prefills' KV goes to the sender. A request without
        a decode leg (it asks at most one token) ends here, its prompt's pages cached."""
        for r in done:
            rec = self.rooms[r.room]
            if rec.alone:
                self.sched.retire(r, RequestState.FINISHED)
                self._forget(r.room)
                continue
            self.sched.hand_off(r)
            self.runner.hand_off(r.pages)  # a TP worker's ranks' heads into the pool KV leaves from
            meta = FirstToken(
                first_token=r.output_ids[0],
                logprob=r.output_logprobs[0] if r.output_logprobs else None,
                top_logprobs=r.output_top_logprobs[0] if r.output_top_logprobs else None,
                cached_tokens=r.cached_tokens,
                weight_version=self.weights.version,
            )
            # The names of the prompt's whole pages: a decode node that holds a prefix of them
            # receives only the pages after it (incremental transfer).
            hashes = block_hashes(r.prompt_ids, self.runner.page_size)
            self.sender.send(r.room, r.pages, len(r.prompt_ids), meta, hashes)

    def _reply(self, done: list[Request]) -> None:
        assert self.link is not None
        for r in done:
            rec = self.rooms[r.room]
            lps = r.params.logprob_start_len >= 0
            self.link.send(
                m.PrefillDone(
                    room=r.room,
                    events=rec.events,
                    first=self._first_output(r),
                    cached_tokens=r.cached_tokens,
                    forward_chunks=rec.chunks,
                    input_logprobs=r.input_logprobs if lps else None,
                    input_top_logprobs=r.input_top_logprobs if lps and r.params.top_logprobs_num else None,
                )
            )
        ld = self.link.load
        ld.queued, ld.running = len(self.sched.waiting), len(self.rooms)
        ld.free_tokens = self.sched.free_tokens

    def _first_output(self, r: Request) -> m.TokenOutput:
        """The first token (the only output token here) as the decode node reports it when the KV lands
        (decode/worker.py `_output`)."""
        logprobs, top_logprobs = r.newest_logprobs(1)
        return m.TokenOutput(
            room=r.room,
            token_ids=r.output_ids[:1],
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            finished=r.finished,
            finish_reason=r.finish_reason,
            weight_version=self.weights.version,
        )

    def _on_transfer_end(self, res: TransferResult) -> None:
        room, state = res.room, res.state
        rec = self.rooms.pop(room, None)
        if rec is not None:
            ok = state is TransferState.SUCCESS
            self.sched.retire(rec.request, RequestState.FINISHED if ok else RequestState.FAILED)
            if rec.reported:  # stopped after its failure was reported
                return
        if state is TransferState.FAILED:
            log.warning("KV transfer of %s failed: %s", room, res.error)
            if res.corrupt:  # the decode found the pages unlike their checksums (shared memory)
                self._report(room, FailCode.KV_CORRUPT, f"KV transfer corrupt: {res.error}")
            else:
                self._report(room, FailCode.TRANSFER, f"KV transfer failed: {res.error}")

    def _fail_internal(self, room: str, exc: BaseException) -> None:
        """`room` fails with code `internal` through the abort path: its pages are freed, never cached."""
        rec = self.rooms.get(room)
        if rec is None or rec.request.state in TERMINAL:
            self._forget(room)
            self._report(room, FailCode.INTERNAL, self.faults.message(exc))
            return
        rec.request.kv_cacheable = False
        self._fail_held(rec.request, FailCode.INTERNAL, self.faults.message(exc))

    def _fail_held(self, r: Request, code: FailCode, message: str) -> None:
        """`r`, held here, fails at once; its pages are freed now or, with its transfer in flight,
        when that transfer ends (whose end then needs no second report)."""
        if self._stop(r) and (rec := self.rooms.get(r.room)) is not None:
            rec.reported = True
        self._report(r.room, code, message)

    def _fail_every(self, code: FailCode, message: str) -> None:
        for rec in list(self.rooms.values()):
            if not rec.reported:  # one failed already waits for its transfer's end
                self._fail_held(rec.request, code, message)

    def _weights_changed(self) -> None:
        """A weight update committed: the KV of every request here may mix versions; never cache it."""
        for rec in self.rooms.values():
            rec.request.kv_cacheable = False

    def _forget(self, room: str) -> None:
        self.rooms.pop(room, None)
