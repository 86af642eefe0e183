"""One generation's life at the gateway: check -> route -> dispatch -> collect -> stitch.

`Generations.prepare` checks prompts against the cluster's limits (before anything is dispatched, so a
batch fails as a whole); `Generations.generate` runs one generation and yields its `GenState` after
every output step, the last one with `finished=True` and `meta_info`. Failures raise `ApiError`
(status naming the failing leg); on any exit that is not a normal finish, the legs still holding
the room are aborted.

A leg that fails for reasons outside the request (`_AGAIN_CODES`) is run again on another pair
under a new room id: before the client may have seen a token that is a retry (at most one); after, a
migration (at most `MAX_MIGRATIONS`). Either way the new pair gets the prompt plus the tokens produced
so far (a retry's: at most the first token, which PrefillDone brought) and the
remaining `max_new_tokens`, and the same `GenState` and `_Collector` (detokenizer and stop-string
state) carry on, so the client sees one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.control import ControlPlane, LegFailed, Room, TokensArrived
from pdserve.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.gateway.errors import ApiError, bad_request
from pdserve.gateway.failed_requests import FailedRequests, request_fingerprint
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.protocol import check_prompt_ids, with_max_new_tokens
from pdserve.gateway.request_trace import RequestTrace, TraceInput, build_trace
from pdserve.gateway.timeline import (
    Timeline,
    TimelineInput,
    decode_throughput,
    spec_accept_length,
    spec_accept_rate,
    stitch,
)
from pdserve.gateway.tokenizer import Tokenizer
from pdserve.gateway.tracing import RequestSpan, Tracing
from pdserve.gateway.workers import WorkerInfo, WorkerRegistry
from pdserve.protocol.gateway import GenerateRequest, PrefillDone, Role, TokenOutput
from pdserve.protocol.records import DecodeEvents, RequestStats
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_FAIL_STATUS = {
    "bad_request": 400,
    "oom": 503,
    "draining": 503,
    "worker_lost": 503,
    "shutdown": 503,
    "transfer": 503,
    "client_abort": 400,
    # The worker's step raised for this request (it goes on): not run again elsewhere, and refused
    # before dispatch after two (`FailedRequests`).
    "internal": 500,
}
# Failures that say nothing about the request itself: worth running again on another pair (the
# client does not notice). "transfer": the KV never reached this decode worker; another may get it.
_AGAIN_CODES = frozenset({"worker_lost", "draining", "transfer"})
# A request that keeps landing on failing workers ends after this many migrations.
MAX_MIGRATIONS = 2


class _Again(Exception):
    """An attempt's leg failed with one of `_AGAIN_CODES`; `generate` decides whether to go on."""

    def __init__(self, ev: LegFailed, room: Room, error: ApiError) -> None:
        super().__init__(error.message)
        self.code, self.error = ev.code, error
        prefill = room.prefill.worker_id if room.prefill is not None else ""  # "": a local prefill
        decode = room.decode.worker_id if room.decode is not None else ""  # "": prefill only
        self.failed = prefill if ev.role == "prefill" else decode
        self.prefill, self.decode = prefill, decode


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
    # Streamed: the client sees each token as it comes (then a leg lost after one migrates; see _again).
    stream: bool = False


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
    finish_reason: dict | None = None
    meta_info: dict | None = None
    cached_tokens: int = 0
    # Prompt logprobs from the request's logprob_start_len on (None for the first prompt token).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Which weights produced which output tokens: [{"version", "start", "end"}], [start, end) covering
    # output_ids once, in order, from the version each worker tagged its outputs with.
    weight_versions: list[dict] = field(default_factory=list)


@dataclass
class _Run:
    """What one generation keeps across its attempts (a retry or migrations)."""

    inp: GenInput
    st: GenState
    c: _Collector
    avoid: set[str] = field(default_factory=set)  # workers that failed an attempt: never again
    prefer_not: set[str] = field(default_factory=set)  # used again only when there is no other
    retries: int = 0
    migrations: int = 0
    dispatched_once: bool = False
    # A decode leg sent tokens (a first token from PrefillDone alone does not count).
    decoded: bool = False
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
        most `MAX_MIGRATIONS` times). Other failures, and those past the limits, raise `ApiError`."""
        st = GenState(inp.rid, len(inp.input_ids))
        run = _Run(inp, st, _Collector(self.tokenizer, inp, st))
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
                except _Again as a:
                    self._again(run, a)
        finally:
            if run.span is not None:  # ended already when the request finished
                run.span.fail("the request did not finish", time.time())

    def _again(self, run: _Run, a: _Again) -> None:
        """Count a retry or a migration and mark the workers to avoid, or raise the failure."""
        produced = len(run.st.output_ids)
        # A retry until the client may have seen a token: a stream's first one (which PrefillDone brings
        # before the decode has the KV), or any decoded one. Either way the next attempt goes on from the
        # tokens produced so far.
        retry = produced == 0 or (not run.inp.stream and not run.decoded)
        if retry and run.retries >= 1:
            raise a.error
        if not retry and run.migrations >= MAX_MIGRATIONS:
            raise ApiError(
                a.error.status, f"{a.error.message} (not migrated: already migrated {run.migrations} times)"
            )
        avoid, prefer_not = set(run.avoid), set(run.prefer_not)
        if a.code == "transfer":
            # Either side may be at fault: another decode worker always, another prefill if there is one.
            avoid.add(a.decode)
            if a.prefill:
                prefer_not.add(a.prefill)
        else:
            avoid.add(a.failed)
        missing = [r for r in ("prefill", "decode") if not self._candidates(r, avoid)]
        if missing:
            what = "retried" if retry else "migrated"
            raise ApiError(
                a.error.status,
                f"{a.error.message} (not {what}: no other {' and no other '.join(missing)} worker in rotation)",
            )
        run.avoid, run.prefer_not = avoid, prefer_not
        if retry:
            run.retries += 1
            self.metrics.retries.inc()
            log.warning("request %s: retrying on another pair after: %s", run.inp.rid, a.error.message)
        else:
            run.migrations += 1
            self.metrics.migrations.inc()
            log.warning(
                "request %s: migrating after %d tokens to another pair after: %s",
                run.inp.rid,
                produced,
                a.error.message,
            )

    def _candidates(self, role: Role, avoid: set[str]) -> list[WorkerInfo]:
        return [w for w in self.registry.in_rotation(role) if w.worker_id not in avoid]

    def _dispatch(
        self, run: _Run, room: Room, prompt: list[int], sampling: SamplingParams, local: bool
    ) -> float:
        """Send the attempt's GenerateRequest to its legs; the dispatch time."""
        prefill, decode = room.prefill, room.decode
        req = GenerateRequest(
            room=room.room,
            input_ids=prompt,
            sampling=sampling,
            prefill_worker=prefill.worker_id if prefill is not None else "",
            prefill_bootstrap_addr=prefill.bootstrap_addr if prefill is not None else "",
            decode_worker=decode.worker_id if decode is not None else "",
            local_prefill=local,
            deadline_s=run.inp.received_ts + self.cfg.request_timeout_s,
            traceparent=run.span.traceparent if run.span is not None else None,
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
        inp, st, c = run.inp, run.st, run.c
        # A migration continues from the tokens produced so far: the new prefill computes their KV
        # and samples the next one; the new decode generates only what is left.
        produced = list(st.output_ids)
        prompt = inp.input_ids + produced
        sampling = inp.sampling
        if produced:
            sampling = with_max_new_tokens(sampling, sampling.max_new_tokens - len(produced))
        hashes: dict[int, list[int]] = {}  # the prompt's block hashes, computed once for all three
        # No decode leg when the prefill's first token is all there is to generate (max_new_tokens 1),
        # or nothing is (0, a prefill-only request: prompt logprobs, a cache warm-up): its answer is
        # PrefillDone's, and no KV moves.
        no_decode = sampling.max_new_tokens <= 1
        decode = None if no_decode else self.registry.pick("decode", run.avoid, prompt, hashes)
        # Conditional disaggregation: the decode worker computes a short uncached prompt itself.
        # Prompt logprobs come from a prefill worker.
        local = (
            decode is not None
            and inp.sampling.logprob_start_len < 0
            and self.registry.prefill_locally(decode, prompt, self._candidates("prefill", run.avoid), hashes)
        )
        prefill = None
        if not local:
            reg = self.registry
            prefill = reg.pick("prefill", run.avoid | run.prefer_not, prompt, hashes) or reg.pick(
                "prefill", run.avoid, prompt, hashes
            )
        if (prefill is None and not local) or (decode is None and not no_decode):
            missing = " and no ".join(
                r for r, w in (("prefill", prefill or local), ("decode", decode or no_decode)) if not w
            )
            retry = " to retry on" if run.avoid else ""
            raise ApiError(503, f"no {missing} worker in rotation{retry}", headers={"Retry-After": "1"})
        room = self.control.open_room(uuid.uuid4().hex, prefill, decode, len(prompt), inp.rid)
        # Legs to abort on the way out; cleared as the request reaches a clean end. Every exit from
        # here on, a failure while dispatching included, goes through the `finally` that closes the room.
        abort_decode: str | None = "cancelled" if decode is not None else None
        abort_prefill: str | None = "cancelled" if prefill is not None else None
        # The first token comes twice: with PrefillDone, as soon as it is sampled, and with the
        # decode's first output, once the KV landed. Whichever comes first counts; the other is dropped.
        first_early = False  # the prefill's copy counted
        decode_spoke = False  # the decode leg sent tokens: it holds this attempt's KV
        try:
            dispatched = self._dispatch(run, room, prompt, sampling, local)
            while not st.finished:
                ev = await self._next_event(room, inp)
                if isinstance(ev, LegFailed):
                    if ev.role == "prefill" and decode_spoke:
                        # The decode holds this attempt's KV already: the prefill is no longer needed.
                        log.info("room %s: prefill leg lost after the KV arrived: %s", room.room, ev.message)
                        abort_prefill = None
                        continue
                    if ev.reported:
                        abort_decode = None if ev.role == "decode" else "other leg failed"
                        abort_prefill = None if ev.role == "prefill" else "other leg failed"
                    err = self._leg_failed(room, ev)
                    if ev.code in _AGAIN_CODES and ev.role in ("prefill", "decode"):
                        raise _Again(ev, room, err)
                    if ev.code == "internal":
                        self.failed_requests.record(run.fingerprint)
                    raise err
                out = ev.output
                if ev.source == "prefill":
                    if decode_spoke:
                        continue
                    first_early = True
                elif out.token_ids:
                    if first_early and not decode_spoke:
                        out = _without_first(out)
                    decode_spoke = run.decoded = True
                st.new_text, st.new_ids = "", 0
                self._observe_itl(c, ev.t_recv, len(out.token_ids))
                if c.first_token_recv is None and out.token_ids:
                    self.metrics.ttft.observe(ev.t_recv - inp.received_ts)
                if run.origin is None and out.token_ids:
                    run.origin = (room, dispatched)
                c.feed(out, ev.t_recv, room.leg(ev.source).clock.offset)
                if out.prefill_events is not None and room.prefill is None and room.prefill_done is None:
                    # A local prefill: the decode worker's first output stands in for PrefillDone.
                    room.prefill_done = PrefillDone(room=room.room, events=out.prefill_events)
                    room.prefill_done_at = ev.t_recv
                    room.prefill_event.set()
                if c.failed is not None:
                    abort_decode = None
                    raise self._leg_failed(room, LegFailed("decode", "aborted", c.failed, True))
                if st.finished and not out.finished:
                    abort_decode = "stop"  # a stop string matched before the decode finished
                elif st.finished:
                    # The decode finished, or will on its own: the prefill's first token ended the request
                    # (the decode, given the same token, stops there too once the KV lands).
                    abort_decode = None
                if st.finished:
                    abort_prefill = None if room.prefill_done is not None else "finished"
                    break
                if st.new_ids or st.new_text:
                    yield st
            await self._wait_prefill_done(room)
            abort_prefill = None
            origin, t_dispatch = run.origin or (room, dispatched)
            st.meta_info, tl = self._meta_info(inp, st, c, origin, t_dispatch, run.migrations)
            self._observe_finish(st, c, local=origin.prefill is None)
            if run.span is not None or self.on_finish is not None:
                trace = self._trace(inp, st, c, origin, tl, run.migrations)
                if run.span is not None:
                    run.span.finish(trace)
                if self.on_finish is not None:
                    self.on_finish(trace)
            yield st
        finally:
            self.control.close_room(room, abort_decode=abort_decode, abort_prefill=abort_prefill)

    async def _next_event(self, room: Room, inp: GenInput) -> TokensArrived | LegFailed:
        remaining = inp.received_ts + self.cfg.request_timeout_s - time.time()
        try:
            ev = await asyncio.wait_for(room.inbox.get(), timeout=max(0.0, remaining))
        except TimeoutError:  # asyncio.TimeoutError is this class from 3.11
            ev = None
        # A worker that saw the deadline (`GenerateRequest.deadline_s`) pass first: one error shape.
        if ev is None or (isinstance(ev, LegFailed) and ev.code == "deadline"):
            self.metrics.errors.labels("gateway", "timeout").inc()
            raise ApiError(
                504,
                f"request {inp.rid} timed out after {self.cfg.request_timeout_s:g} s "
                f"(prefill {room.prefill.worker_id if room.prefill else 'local'}, "
                f"decode {room.decode.worker_id if room.decode is not None else 'none: the prefill answers'})",
            )
        return ev

    def _leg_failed(self, room: Room, ev: LegFailed) -> ApiError:
        self.metrics.errors.labels(ev.role, ev.code).inc()
        status = _FAIL_STATUS.get(ev.code, 500)
        if ev.role not in ("prefill", "decode"):
            return ApiError(status, f"request aborted [{ev.code}]: {ev.message}")
        worker = room.prefill if ev.role == "prefill" else room.decode
        wid = worker.worker_id if worker is not None else "local"
        return ApiError(status, f"{ev.role} leg ({wid}) failed [{ev.code}]: {ev.message}")

    async def _wait_prefill_done(self, room: Room) -> None:
        # PrefillDone may trail the decode's first tokens; its event times are worth a short wait.
        if room.prefill_done is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(room.prefill_event.wait(), self.cfg.prefill_done_grace_s)
        if room.prefill_done is None:
            log.warning("room %s: no PrefillDone; timeline without prefill events", room.room)

    def _observe_itl(self, c: _Collector, t_recv: float, n: int) -> None:
        if c.last_recv is not None and n > 0:
            per_token = (t_recv - c.last_recv) / n
            for _ in range(n):
                self.metrics.itl.observe(per_token)

    def _observe_finish(self, st: GenState, c: _Collector, local: bool) -> None:
        assert st.meta_info is not None and st.finish_reason is not None
        self.metrics.e2e.observe(st.meta_info["e2e_latency"])
        self.metrics.requests.labels(st.finish_reason["type"]).inc()
        self.metrics.generation_tokens.inc(len(st.output_ids))
        self.metrics.spec(c.stats)
        self.metrics.cached_tokens.inc(st.cached_tokens)
        self.metrics.kv_transfer_bytes.inc(c.stats.get("transfer_bytes", 0))
        if not local:  # a transfer's prefix the decode worker held: those pages did not travel
            self.metrics.transfer_skipped_tokens.inc(c.stats.get("decode_cached_tokens", 0))

    def _trace(
        self, inp: GenInput, st: GenState, c: _Collector, room: Room, tl: Timeline, migrations: int
    ) -> RequestTrace:
        pd = room.prefill_done
        assert st.meta_info is not None
        return build_trace(
            TraceInput(
                rid=inp.rid,
                tl=tl,
                prefill_worker=room.prefill.worker_id if room.prefill is not None else "",
                decode_worker=room.decode.worker_id if room.decode is not None else "",
                prefill_events=pd.events if pd is not None else {},
                prefill_offset=room.leg("prefill").clock.offset,
                forward_chunks=pd.forward_chunks if pd is not None else [],
                decode_events=c.decode_events,
                stats=c.stats,
                prompt_tokens=st.prompt_tokens,
                completion_tokens=len(st.output_ids),
                cached_tokens=st.cached_tokens,
                migrations=migrations,
                meta_info=st.meta_info,
            )
        )

    def _meta_info(
        self, inp: GenInput, st: GenState, c: _Collector, room: Room, dispatched: float, migrations: int
    ) -> tuple[dict, Timeline]:
        """`room`: the attempt that delivered the first token (its prefill events are the request's)."""
        pd = room.prefill_done
        now = time.time()
        tl = stitch(
            TimelineInput(
                request_received=inp.received_ts,
                dispatch_finished=dispatched,
                first_token_recv=c.first_token_recv if c.first_token_recv is not None else c.final_recv,
                final_recv=c.final_recv,
                response_sent=now,
                prefill_done_recv=room.prefill_done_at,
                prefill_events=pd.events if pd is not None else {},
                # A local prefill's events are on the decode worker's clock.
                prefill_offset=room.leg("prefill").clock.offset,
                decode_events=c.decode_events,
                decode_offset=0.0,  # mapped onto the gateway clock as they arrived (see _Collector)
                completion_tokens=len(st.output_ids),
            )
        )
        s = c.stats
        ct = len(st.output_ids)
        # The node that computed the prompt: its cache hit is what saved computation.
        if room.prefill is None:
            cached = s.get("decode_cached_tokens", 0)
        else:
            cached = pd.cached_tokens if pd is not None else 0
        st.cached_tokens = cached
        correct, proposed = s.get("spec_num_correct_drafts", 0), s.get("spec_num_proposed_drafts", 0)
        verify = s.get("spec_verify_ct", 0)
        meta = {
            "id": inp.rid,
            "finish_reason": st.finish_reason,
            "prompt_tokens": st.prompt_tokens,
            "weight_version": st.weight_versions[-1]["version"]
            if st.weight_versions
            else self.registry.weight_version,
            "num_retractions": s.get("num_retractions", 0),
            "storage_prefetch_wait": 0.0,
            "storage_staging_wait": 0.0,
            "forward_entry_time": tl.forward_entry_time,
            "prefill_finished_time": tl.prefill_finished_time,
            "queue_time": tl.queue_time,
            "reasoning_tokens": 0,
            "completion_tokens": ct,
            "cached_tokens": cached,
            "weight_versions": [dict(s) for s in st.weight_versions],
            "cached_tokens_details": {"device": cached, "host": 0},
            "dp_rank": None,
            "e2e_latency": tl.e2e_latency,
            "spec_accept_rate": spec_accept_rate(correct, proposed),
            "spec_accept_length": spec_accept_length(ct, verify),
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify,
            "spec_correct_drafts_histogram": s.get("spec_correct_drafts_histogram", []),
            "request_received_ts": tl.request_received_ts,
            "first_token_latency": tl.first_token_latency,
            "api_server_dispatch_finish_ts": tl.api_server_dispatch_finish_ts,
            "request_finished_ts": tl.request_finished_ts,
            "decode_throughput": decode_throughput(ct, tl.first_token_ts, tl.request_finished_ts),
            "response_sent_to_client_ts": tl.response_sent_to_client_ts,
        }
        if migrations:  # only then: an uninterrupted request keeps SGLang's exact meta_info shape
            meta["num_migrations"] = migrations
        if inp.sampling.logprobs:
            start = inp.sampling.logprob_start_len
            if start >= 0 and pd is not None and pd.input_logprobs is not None:
                # Prompt logprobs, computed by the prefill node (runtime/prompt_logprobs.py).
                ids = inp.input_ids[start:]
                st.input_logprobs = list(pd.input_logprobs)
                st.input_top_logprobs = pd.input_top_logprobs
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(pd.input_logprobs, ids)]
                if inp.sampling.top_logprobs_num > 0 and pd.input_top_logprobs is not None:
                    meta["input_top_logprobs"] = [
                        None if top is None else [[lp, t, None] for t, lp in top]
                        for top in pd.input_top_logprobs
                    ]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(st.logprobs, st.output_ids)]
            if inp.sampling.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in st.top_logprobs]
        return meta, tl


def _without_first(out: TokenOutput) -> TokenOutput:
    """The decode's first output less the first token, which the prefill's PrefillDone delivered."""
    return out.model_copy(
        update={
            "token_ids": out.token_ids[1:],
            "logprobs": out.logprobs[1:] if out.logprobs is not None else None,
            "top_logprobs": out.top_logprobs[1:] if out.top_logprobs is not None else None,
        }
    )


def _count_version(segments: list[dict], version: str, end: int) -> None:
    """One more output token (the `end`-th) made by `version`: extend the last segment or start one."""
    if segments and segments[-1]["version"] == version:
        segments[-1]["end"] = end
    else:
        segments.append({"version": version, "start": end - 1, "end": end})


class _Collector:
    """Turns the decode's outputs for one room into released text, ids and finish state."""

    def __init__(self, tok: Tokenizer, inp: GenInput, st: GenState) -> None:
        skip = inp.skip_special_tokens
        self.detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip), inp.input_ids)
        self.stop = StopStringMatcher(inp.sampling.stop, inp.sampling.no_stop_trim)
        self.st = st
        # On the gateway clock: a migrated request's legs ran on decode workers with other offsets.
        # The first leg's entry and KV arrival, the last leg's finish.
        self.decode_events: DecodeEvents = {}
        self.stats: RequestStats = {}
        self.first_token_recv: float | None = None
        self.last_recv: float | None = None
        self.final_recv: float = 0.0
        self.failed: str | None = None

    def feed(self, out: TokenOutput, t_recv: float, decode_offset: float) -> None:
        st = self.st
        for name, t in (out.events or {}).items():
            if name == "finished" or name not in self.decode_events:
                self.decode_events[name] = t - decode_offset
        if out.stats:
            self.stats = out.stats
        if out.token_ids:
            if self.first_token_recv is None:
                self.first_token_recv = t_recv
            self.last_recv = t_recv
        fr = out.finish_reason if out.finished else None
        if fr is not None and fr.get("type") == "abort":
            self.failed = str(fr.get("message", "aborted by the decode worker"))
            return
        # A matched stop token is counted in output_ids but not shown in the text (SGLang).
        hidden_last = (
            fr is not None
            and fr.get("type") == "stop"
            and not self.stop.keep_stop
            and out.token_ids
            and fr.get("matched") == out.token_ids[-1]
        )
        for i, tid in enumerate(out.token_ids):
            st.output_ids.append(tid)
            st.new_ids += 1
            _count_version(st.weight_versions, out.weight_version, len(st.output_ids))
            if out.logprobs is not None and i < len(out.logprobs):
                st.logprobs.append(out.logprobs[i])
            if out.top_logprobs is not None and i < len(out.top_logprobs):
                st.top_logprobs.append(list(out.top_logprobs[i]))
            if hidden_last and i == len(out.token_ids) - 1:
                break
            self._release(self.stop.feed(self.detok.add(tid)))
            if self.stop.matched is not None:
                self._finish({"type": "stop", "matched": self.stop.matched}, t_recv)
                return
        if out.finished:
            self._release(self.stop.feed(self.detok.flush()))
            if self.stop.matched is not None:
                fr = {"type": "stop", "matched": self.stop.matched}
            self._release(self.stop.finish())
            if fr is None or fr.get("type") == "length":
                # The whole generation's length: a migrated leg counts only its own tokens.
                fr = {"type": "length", "length": len(st.output_ids)}
            self._finish(fr, t_recv)

    def _release(self, text: str) -> None:
        self.st.text += text
        self.st.new_text += text

    def _finish(self, reason: dict, t_recv: float) -> None:
        self.st.finished = True
        self.st.finish_reason = reason
        self.final_recv = t_recv
