"""One generation's life at the gateway: check -> route -> dispatch -> collect -> stitch.

`Generations.prepare` checks prompts against the cluster's limits (before anything is dispatched, so a
batch fails as a whole); `Generations.generate` runs one generation and yields its `GenState` after
every output step, the last one with `finished=True` and `meta_info`. Failures raise `ApiError`
(status naming the failing leg); on any exit that is not a normal finish, the legs still holding
the room are aborted.

Each attempt is routed (routing.py), opens a room at the control plane and reads it (room_reader.py);
the outputs go into the `GenState` through the `Collector` (collector.py); the finished request's
meta_info and trace are built in request_trace.py. A leg that fails for reasons outside the request is
run again on another pair (retries.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.gateway.cluster.control import ControlPlane
from pdserve.gateway.cluster.rooms import LegFailed, Room, RoomAborted, TokensArrived
from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import FAIL_STATUS, ApiError, bad_request
from pdserve.gateway.generation.collector import Collector, WeightSegment
from pdserve.gateway.generation.failed_requests import FailedRequests, request_fingerprint
from pdserve.gateway.generation.request_trace import (
    FinishedRequest,
    RequestTrace,
    build_meta_info,
    build_request_trace,
    cached_tokens,
    prompt_logprobs,
    timeline,
)
from pdserve.gateway.generation.retries import AGAIN_CODES, Attempts, TryAgain
from pdserve.gateway.generation.room_reader import RoomReader
from pdserve.gateway.generation.routing import Route, RouteWhy, pinned_route, route
from pdserve.gateway.generation.tracing import RequestSpan, Tracing
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.gateway.protocol import check_prompt_ids, with_max_new_tokens
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.protocol.gateway import GenerateRequest
from pdserve.protocol.vocabulary import FailCode, FinishReason
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenInput:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    # False: max_new_tokens was not given and may be capped to the remaining context (SGLang).
    max_new_tokens_given: bool
    received_ts: float
    skip_special_tokens: bool = True
    # The client's W3C trace context (the `traceparent` header): the parent of the request's trace.
    traceparent: str | None = None
    # Streamed: the client sees each token as it comes (then a leg lost after one migrates; see `Attempts.again`).
    stream: bool = False
    # A canary's (gateway/autopilot/canary.py): run on exactly this (prefill, decode) pair, never elsewhere.
    pinned: tuple[str, str] | None = None
    # False: neither leg reads or fills its prefix cache (GenerateRequest.use_prefix_cache).
    use_prefix_cache: bool = True


@dataclass
class GenState:
    rid: str
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # released text so far (stop strings cut, held-back text excluded)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Since the previous yield.
    new_text: str = ""
    new_ids: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    meta_info: dict[str, Any] | None = None
    cached_tokens: int = 0
    # Prompt logprobs from the request's logprob_start_len on (None for the first prompt token).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Which weights produced which output tokens: [{"version", "start", "end"}], [start, end) covering
    # output_ids once, in order, from the version each worker tagged its outputs with.
    weight_versions: list[WeightSegment] = field(default_factory=list)


@dataclass
class _Run:
    """What one generation keeps across its attempts (a retry or migrations)."""

    inp: GenInput
    st: GenState
    c: Collector
    attempts: Attempts
    dispatched_once: bool = False
    # The attempt that delivered the first token: its prefill events and dispatch time go in meta_info.
    origin: tuple[Room, float] | None = None
    span: RequestSpan | None = None  # the trace's root, with tracing on
    fingerprint: str = ""  # request_fingerprint: counted when a worker fails it with code internal


class Generations:
    def __init__(
        self,
        cfg: GatewayConfig,
        tokenizer: Tokenizer,
        registry: WorkerRegistry,
        control: ControlPlane,
        metrics: GatewayMetrics,
        tracing: Tracing | None = None,
        on_finish: Callable[[RequestTrace], None] | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.registry, self.control, self.metrics = (
            cfg,
            tokenizer,
            registry,
            control,
            metrics,
        )
        # OpenTelemetry export (None: off) and the dashboard's recent requests: both take each
        # finished request's spans, built once.
        self.tracing, self.on_finish = tracing, on_finish
        # Requests that made a worker's step raise; refused once they did twice.
        self.failed_requests = FailedRequests()

    # ---- before dispatch ---------------------------------------------------------------------

    def prepare(self, inputs: list[GenInput], param: str) -> list[GenInput]:
        """400 for prompts the cluster cannot take, 503 without workers; fills max_new_tokens."""
        limits = self.registry.limits()
        vocab = limits.vocab_size if limits else self.tokenizer.vocab_size
        for inp in inputs:
            check_prompt_ids(inp.input_ids, vocab, param)
        if limits is None or not self.registry.healthy():
            self.metrics.rejected.labels("no_workers").inc()
            missing = [r for r in ("prefill", "decode") if not self.registry.in_rotation(r)]
            raise ApiError(
                503, f"no {' and no '.join(missing)} worker in rotation", headers={"Retry-After": "1"}
            )
        # A request must fit the context and the KV pool of whichever decode worker it lands on.
        ctx, what = limits.context_length, "the context length"
        if limits.decode_capacity < ctx:
            ctx, what = limits.decode_capacity, "the decode workers' KV capacity"
        out = []
        for inp in inputs:
            n, m = len(inp.input_ids), inp.sampling.max_new_tokens
            if inp.max_new_tokens_given:
                if n + m > ctx:
                    raise bad_request(
                        f"requested {n + m} tokens ({n} in the prompt + {m} to generate), "
                        f"but {what} is {ctx} tokens",
                        param,
                    )
            elif n >= ctx:
                raise bad_request(f"the prompt has {n} tokens; {what} is {ctx} tokens", param)
            else:
                inp = replace(inp, sampling=with_max_new_tokens(inp.sampling, min(m, ctx - n)))
            out.append(inp)
        return out

    # ---- one generation ----------------------------------------------------------------------

    async def generate(self, inp: GenInput) -> AsyncIterator[GenState]:
        """One generation. A leg lost (or draining, or a failed KV transfer) before the client may have
        seen a token is retried once on another pair; after, the generation migrates to another pair (at
        most `retries.MAX_MIGRATIONS` times). Other failures, and those past the limits, raise `ApiError`."""
        st = GenState(inp.rid, len(inp.input_ids))
        run = _Run(inp, st, Collector(self.tokenizer, inp, st), Attempts(inp.rid, inp.stream))
        run.fingerprint = request_fingerprint(inp.input_ids, inp.sampling)
        if self.failed_requests.refused(run.fingerprint):
            self.metrics.rejected.labels("failed_workers").inc()
            raise ApiError(
                422,
                f"this request (the same prompt and sampling parameters) failed a worker's step "
                f"{self.failed_requests.refuse_after} times with an internal error; it is refused",
                code="request_failed_workers",
            )
        if self.tracing is not None:
            run.span = self.tracing.begin(inp.received_ts, inp.traceparent)
        try:
            while True:
                try:
                    async for s in self._attempt(run):
                        yield s
                    return
                except TryAgain as a:
                    if inp.pinned is not None:  # a pinned pair's failure is the answer
                        raise a.error from None
                    run.attempts.again(a, len(st.output_ids), self.registry, self.metrics)
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled or closed before its end: its client left (its legs are aborted on the way out).
            if not st.finished:
                self.metrics.request_aborts.labels("client_disconnect").inc()
            raise
        finally:
            if run.span is not None:  # ended already when the request finished
                run.span.fail("the request did not finish", time.time())

    def _dispatch(
        self, run: _Run, r: Route, room: Room, prompt: list[int], sampling: SamplingParams
    ) -> float:
        """Send the attempt's GenerateRequest to its legs; the dispatch time."""
        prefill, decode = r.prefill, r.decode
        req = GenerateRequest(
            room=room.room,
            input_ids=prompt,
            sampling=sampling,
            prefill_worker=prefill.worker_id if prefill is not None else "",
            prefill_bootstrap_addr=prefill.bootstrap_addr if prefill is not None else "",
            decode_worker=decode.worker_id if decode is not None else "",
            local_prefill=r.why == RouteWhy.LOCAL_PREFILL,
            deadline_s=run.inp.received_ts + self.cfg.request_timeout_s,
            traceparent=run.span.traceparent if run.span is not None else None,
            use_prefix_cache=run.inp.use_prefix_cache,
        )
        if prefill is not None:
            self.control.send(prefill, req)
            self.metrics.routed.labels("prefill", prefill.worker_id).inc()
        else:
            self.metrics.local_prefill.inc()
        if decode is not None:
            self.control.send(decode, req)
            self.metrics.routed.labels("decode", decode.worker_id).inc()
        if not run.dispatched_once:
            run.dispatched_once = True
            self.metrics.prompt_tokens.inc(len(run.inp.input_ids))  # the client's prompt, counted once
        return time.time()

    async def _attempt(self, run: _Run) -> AsyncIterator[GenState]:
        """One attempt on one pair: route, open the room, dispatch, read the room until the request
        finishes (yielding after every output step), then build its meta_info."""
        inp, st = run.inp, run.st
        # A migration continues from the tokens produced so far: the new prefill computes their KV
        # and samples the next one; the new decode generates only what is left.
        produced = list(st.output_ids)
        prompt = inp.input_ids + produced
        sampling = inp.sampling
        if produced:
            sampling = with_max_new_tokens(sampling, sampling.max_new_tokens - len(produced))
        if inp.pinned is not None:
            r = pinned_route(self.registry, *inp.pinned)
        else:
            r = route(self.registry, prompt, sampling, run.attempts.avoid, run.attempts.prefer_not)
        room = self.control.open_room(uuid.uuid4().hex, r.prefill, r.decode, len(prompt), inp.rid)
        reader = RoomReader(room, inp.received_ts + self.cfg.request_timeout_s)
        # Every exit from here on, a failure while dispatching included, goes through the `finally`
        # that closes the room and aborts the legs `reader` names.
        try:
            dispatched = self._dispatch(run, r, room, prompt, sampling)
            while not st.finished:
                ev = await reader.next()
                if not isinstance(ev, TokensArrived):
                    raise self._failure(run, room, ev)
                run.attempts.decoded = run.attempts.decoded or reader.decode_spoke
                self._collect(run, room, ev, dispatched)
                if run.c.failed is not None:  # the decode leg finished with an abort: it has ended
                    reader.abort_decode = None
                    failed = LegFailed("decode", FailCode.ABORTED, run.c.failed, reported=True)
                    raise self._failure(run, room, failed)
                if st.finished:
                    reader.finished(ev.output.finished)
                elif st.new_ids or st.new_text:
                    yield st
            await self._wait_prefill_done(room)
            reader.abort_prefill = None
            self._finish(run, room, dispatched)
            yield st
        finally:
            self.control.close_room(
                room, abort_decode=reader.abort_decode, abort_prefill=reader.abort_prefill
            )

    def _collect(self, run: _Run, room: Room, ev: TokensArrived, dispatched: float) -> None:
        """Take an output step into the generation's state."""
        st, c, out = run.st, run.c, ev.output
        st.new_text, st.new_ids = "", 0
        self._observe_itl(c, ev.t_recv, len(out.token_ids))
        if c.first_token_recv is None and out.token_ids:
            self.metrics.ttft.observe(ev.t_recv - run.inp.received_ts)
        if run.origin is None and out.token_ids:
            run.origin = (room, dispatched)
        c.feed(out, ev.t_recv, room.leg(ev.source).clock.offset)

    def _failure(self, run: _Run, room: Room, ev: LegFailed | RoomAborted) -> Exception:
        """What an attempt's end by `ev` raises: an `ApiError`, or `_Again` when another pair may do."""
        if ev.code == FailCode.DEADLINE:  # the gateway's deadline or a worker's: one error
            self.metrics.errors.labels("gateway", "timeout").inc()
            prefill = room.prefill.worker_id if room.prefill is not None else "local"
            decode = room.decode.worker_id if room.decode is not None else "none: the prefill answers"
            return ApiError(
                FAIL_STATUS[ev.code],
                f"request {run.inp.rid} timed out after {self.cfg.request_timeout_s:g} s "
                f"(prefill {prefill}, decode {decode})",
            )
        status = FAIL_STATUS[ev.code]
        if isinstance(ev, RoomAborted):
            self.metrics.errors.labels("gateway", ev.code).inc()
            if ev.code == FailCode.CLIENT_ABORT:
                self.metrics.request_aborts.labels("abort_request").inc()
            return ApiError(status, f"request aborted [{ev.code}]: {ev.message}")
        self.metrics.errors.labels(ev.role, ev.code).inc()
        if ev.code == FailCode.KV_CORRUPT:  # once per attempt, whichever leg reported it first
            self.metrics.kv_corrupt.inc()
        worker = room.prefill if ev.role == "prefill" else room.decode
        wid = worker.worker_id if worker is not None else "local"
        err = ApiError(status, f"{ev.role} leg ({wid}) failed [{ev.code}]: {ev.message}")
        if ev.code in AGAIN_CODES:
            return TryAgain(ev, room, err)
        if ev.code == FailCode.INTERNAL:
            self.failed_requests.record(run.fingerprint)
        return err

    async def _wait_prefill_done(self, room: Room) -> None:
        # PrefillDone may trail the decode's first tokens; its event times are worth a short wait.
        if room.prefill_done is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(room.prefill_event.wait(), self.cfg.prefill_done_grace_s)
        if room.prefill_done is None:
            log.warning("room %s: no PrefillDone; timeline without prefill events", room.room)

    def _finish(self, run: _Run, room: Room, dispatched: float) -> None:
        """The finished generation's meta_info and prompt logprobs; its metrics and trace."""
        st = run.st
        origin, t_dispatch = run.origin or (room, dispatched)
        migrations = run.attempts.migrations
        f = FinishedRequest(run.inp, st, run.c, origin, t_dispatch, migrations, self.registry.weight_version)
        tl = timeline(f)
        st.cached_tokens = cached_tokens(f)
        pd = prompt_logprobs(f)
        if pd is not None:
            st.input_logprobs, st.input_top_logprobs = list(pd.input_logprobs or []), pd.input_top_logprobs
        st.meta_info = build_meta_info(f, tl, st.cached_tokens)
        self._observe_finish(st, run.c, local=origin.prefill is None)
        if room.decode is not None:  # the worker that decoded the end, whose stats these are
            stats = run.c.stats
            room.decode.count_spec(stats.get("spec_verify_ct", 0), stats.get("spec_num_correct_drafts", 0))
        if run.span is not None or self.on_finish is not None:
            trace = build_request_trace(f, tl, st.meta_info)
            if run.span is not None:
                run.span.finish(trace)
            if self.on_finish is not None:
                self.on_finish(trace)

    def _observe_itl(self, c: Collector, t_recv: float, n: int) -> None:
        if c.last_recv is not None and n > 0:
            per_token = (t_recv - c.last_recv) / n
            for _ in range(n):
                self.metrics.itl.observe(per_token)

    def _observe_finish(self, st: GenState, c: Collector, local: bool) -> None:
        assert st.meta_info is not None and st.finish_reason is not None
        self.metrics.e2e.observe(st.meta_info["e2e_latency"])
        self.metrics.requests.labels(st.finish_reason["type"]).inc()
        self.metrics.generation_tokens.inc(len(st.output_ids))
        self.metrics.spec(c.stats)
        self.metrics.cached_tokens.inc(st.cached_tokens)
        self.metrics.kv_transfer_bytes.inc(c.stats.get("transfer_bytes", 0))
        if not local:  # a transfer's prefix the decode worker held: those pages did not travel
            self.metrics.transfer_skipped_tokens.inc(c.stats.get("decode_cached_tokens", 0))
