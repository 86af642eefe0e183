"""One finished request's record: its `meta_info` (SGLang's shape), and its spans and phases on the
gateway's clock.

Built at the request's end from what the gateway already holds (`FinishedRequest`): the stitched
`Timeline` (timeline.py) and the workers' event records, each mapped over with its worker's clock offset
(clock.py), then clamped so that every child span lies inside its parent and after what caused it. The
spans and phases (`RequestTrace`) feed the OpenTelemetry export (tracing.py) and the dashboard
(dashboard.py); neither sees prompt or output text.

Spans (all children of `request`, the gateway's root):

  prefill.queue       GenerateRequest admitted by the prefill worker -> its first forward
  prefill.forward     one per extend forward that computed part of the prompt (chunked prefill)
  kv_transfer.send    the prefill worker hands the KV to its sender -> the decode worker has it
  decode.admission    GenerateRequest admitted by the decode worker -> pages given, KV asked for
  kv_transfer.recv    KV asked for -> KV and first token arrived
  decode              first token on the decode worker -> the request finished there
  response            the decode worker finished -> the response left the gateway

Phases (the dashboard's bar, consecutive, summing to `response_sent - received`):
queue, prefill, transfer, first_token (first token's way to the gateway), decode, response. The
first token usually reaches the gateway with PrefillDone, before the KV lands: then first_token runs
from the prefill's end and transfer from the first token to the KV's arrival.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.gateway.cluster.rooms import Room
from pdserve.gateway.generation.collector import Collector
from pdserve.gateway.observe.timeline import (
    Timeline,
    TimelineInput,
    clamp,
    decode_throughput,
    spec_accept_length,
    spec_accept_rate,
    stitch,
)
from pdserve.protocol.gateway import PrefillDone
from pdserve.protocol.records import DecodeEvents, PrefillEvents, RequestStats

if TYPE_CHECKING:
    from pdserve.gateway.generation.generation import GenInput, GenState

Attr = str | int | float | bool
PHASES = ("queue", "prefill", "transfer", "first_token", "decode", "response")


@dataclass(frozen=True)
class SpanRecord:
    name: str
    start: float  # gateway clock, epoch seconds
    end: float
    attributes: dict[str, Attr] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestTrace:
    rid: str
    start: float  # request received (gateway clock)
    end: float  # response sent
    prefill_worker: str  # "" when the decode worker computed the prompt
    decode_worker: str
    phases: dict[str, float]  # seconds, in PHASES order
    spans: list[SpanRecord]
    attributes: dict[str, Attr]  # the root span's
    meta_info: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int

    def to_json(self) -> dict[str, Any]:
        """For the dashboard: times relative to the request's start, no text."""
        return {
            "rid": self.rid,
            "start": self.start,
            "duration": self.end - self.start,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "phases": self.phases,
            "spans": [
                {
                    "name": s.name,
                    "start": s.start - self.start,
                    "duration": s.end - s.start,
                    "attributes": s.attributes,
                }
                for s in self.spans
            ],
            # Token ids are the text in another form: the logprob lists stay out.
            "meta_info": {k: v for k, v in self.meta_info.items() if "logprobs" not in k},
        }


@dataclass(frozen=True)
class TraceInput:
    rid: str
    tl: Timeline
    prefill_worker: str
    decode_worker: str
    prefill_events: PrefillEvents  # worker clock
    prefill_offset: float
    forward_chunks: list[tuple[float, float]]  # worker clock
    decode_events: DecodeEvents  # already on the gateway clock (Collector.feed)
    stats: RequestStats
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    migrations: int
    meta_info: dict[str, Any]


def build_trace(t: TraceInput) -> RequestTrace:
    tl = t.tl
    received, fe, pf, first = (
        tl.request_received_ts,
        tl.forward_entry_time,
        tl.prefill_finished_time,
        tl.first_token_ts,
    )
    fin, sent = tl.request_finished_ts, tl.response_sent_to_client_ts
    kr = t.decode_events.get("kv_ready")
    kv_ready = clamp(kr if kr is not None else pf, pf, fin)
    if kv_ready <= first:  # the decode's output carried the first token
        transfer, first_token, decode = kv_ready - pf, first - kv_ready, fin - first
    else:  # PrefillDone carried it; the KV landed after
        transfer, first_token, decode = kv_ready - first, first - pf, fin - kv_ready
    phases = dict(zip(PHASES, (fe - received, pf - fe, transfer, first_token, decode, sent - fin)))
    finish = t.meta_info.get("finish_reason") or {}
    attributes: dict[str, Attr] = {
        "pdserve.rid": t.rid,
        "pdserve.prefill_worker": t.prefill_worker or "local",
        "pdserve.decode_worker": t.decode_worker,
        "pdserve.prompt_tokens": t.prompt_tokens,
        "pdserve.cached_tokens": t.cached_tokens,
        "pdserve.completion_tokens": t.completion_tokens,
        "pdserve.finish_reason": str(finish.get("type", "")),
        "pdserve.num_migrations": t.migrations,
    }
    return RequestTrace(
        rid=t.rid,
        start=received,
        end=sent,
        prefill_worker=t.prefill_worker,
        decode_worker=t.decode_worker,
        phases=phases,
        spans=_spans(t, kv_ready),
        attributes=attributes,
        meta_info=t.meta_info,
        prompt_tokens=t.prompt_tokens,
        cached_tokens=t.cached_tokens,
    )


def _spans(t: TraceInput, kv_ready: float) -> list[SpanRecord]:
    """The request's spans, each clamped inside its parent and after what caused it."""
    tl, off = t.tl, t.prefill_offset
    dispatched, fe, pf = tl.api_server_dispatch_finish_ts, tl.forward_entry_time, tl.prefill_finished_time
    fin, sent = tl.request_finished_ts, tl.response_sent_to_client_ts
    qe_raw = t.prefill_events.get("queue_entry")
    queue_entry = clamp(qe_raw - off if qe_raw is not None else dispatched, dispatched, fe)
    de = t.decode_events.get("decode_entry")
    decode_entry = clamp(de if de is not None else dispatched, dispatched, kv_ready)
    kq = t.decode_events.get("kv_requested")
    kv_requested = clamp(kq if kq is not None else decode_entry, decode_entry, kv_ready)

    worker_p = t.prefill_worker or t.decode_worker
    spans = [SpanRecord("prefill.queue", queue_entry, fe, {"pdserve.worker": worker_p})]
    for i, (start, end) in enumerate(t.forward_chunks or [(fe + off, pf + off)]):
        cs = clamp(start - off, fe, pf)
        spans.append(
            SpanRecord(
                "prefill.forward",
                cs,
                clamp(end - off, cs, pf),
                {"pdserve.worker": worker_p, "pdserve.chunk": i},
            )
        )
    path = str(t.stats.get("kv_path", "local" if not t.prefill_worker else "unknown"))
    kv: dict[str, Attr] = {"pdserve.kv.bytes": int(t.stats.get("transfer_bytes", 0)), "pdserve.kv.path": path}
    spans.append(SpanRecord("kv_transfer.send", pf, kv_ready, {"pdserve.worker": worker_p, **kv}))
    spans.append(
        SpanRecord("decode.admission", decode_entry, kv_requested, {"pdserve.worker": t.decode_worker})
    )
    spans.append(
        SpanRecord("kv_transfer.recv", kv_requested, kv_ready, {"pdserve.worker": t.decode_worker, **kv})
    )
    stats = t.stats
    decode: dict[str, Attr] = {
        "pdserve.worker": t.decode_worker,
        "pdserve.completion_tokens": t.completion_tokens,
        "pdserve.spec.verify_ct": int(stats.get("spec_verify_ct", 0)),
        "pdserve.spec.num_proposed_drafts": int(stats.get("spec_num_proposed_drafts", 0)),
        "pdserve.spec.num_correct_drafts": int(stats.get("spec_num_correct_drafts", 0)),
        "pdserve.num_retractions": int(stats.get("num_retractions", 0)),
    }
    spans.append(SpanRecord("decode", kv_ready, fin, decode))
    spans.append(SpanRecord("response", fin, sent, {}))
    return spans


# ---- from the generation's state --------------------------------------------------------------------


@dataclass(frozen=True)
class FinishedRequest:
    """What the gateway holds when a generation finished."""

    inp: GenInput
    st: GenState
    c: Collector  # the decode side of every attempt, on the gateway clock
    # The attempt that delivered the first token, and its dispatch time: its prefill events are the request's.
    room: Room
    dispatched: float
    migrations: int
    weight_version: str  # the cluster's: the request's when no worker tagged its outputs


def timeline(f: FinishedRequest) -> Timeline:
    c, room, pd = f.c, f.room, f.room.prefill_done
    return stitch(
        TimelineInput(
            request_received=f.inp.received_ts,
            dispatch_finished=f.dispatched,
            first_token_recv=c.first_token_recv if c.first_token_recv is not None else c.final_recv,
            final_recv=c.final_recv,
            response_sent=time.time(),
            prefill_done_recv=room.prefill_done_at,
            prefill_events=pd.events if pd is not None else {},
            # A local prefill's events are on the decode worker's clock.
            prefill_offset=room.leg("prefill").clock.offset,
            decode_events=c.decode_events,
            decode_offset=0.0,  # mapped onto the gateway clock as they arrived (Collector.feed)
            completion_tokens=len(f.st.output_ids),
        )
    )


def cached_tokens(f: FinishedRequest) -> int:
    """The prompt tokens the node that computed the prompt had cached: what saved computation."""
    pd = f.room.prefill_done
    if f.room.prefill is None:
        return f.c.stats.get("decode_cached_tokens", 0)
    return pd.cached_tokens if pd is not None else 0


def prompt_logprobs(f: FinishedRequest) -> PrefillDone | None:
    """The PrefillDone carrying the prompt logprobs the request asked for (computed by the prefill node,
    runtime/prompt_logprobs.py), or None."""
    pd, sampling = f.room.prefill_done, f.inp.sampling
    if (
        sampling.logprobs
        and sampling.logprob_start_len >= 0
        and pd is not None
        and pd.input_logprobs is not None
    ):
        return pd
    return None


def build_meta_info(f: FinishedRequest, tl: Timeline, cached: int) -> dict[str, Any]:
    """SGLang's `meta_info`, in its order."""
    st, s = f.st, f.c.stats
    ct = len(st.output_ids)
    correct, proposed = s.get("spec_num_correct_drafts", 0), s.get("spec_num_proposed_drafts", 0)
    verify = s.get("spec_verify_ct", 0)
    meta: dict[str, Any] = {
        "id": f.inp.rid,
        "finish_reason": st.finish_reason,
        "prompt_tokens": st.prompt_tokens,
        "weight_version": st.weight_versions[-1]["version"] if st.weight_versions else f.weight_version,
        "num_retractions": s.get("num_retractions", 0),
        "storage_prefetch_wait": 0.0,
        "storage_staging_wait": 0.0,
        "forward_entry_time": tl.forward_entry_time,
        "prefill_finished_time": tl.prefill_finished_time,
        "queue_time": tl.queue_time,
        "reasoning_tokens": 0,
        "completion_tokens": ct,
        "cached_tokens": cached,
        "weight_versions": [dict(seg) for seg in st.weight_versions],
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
    if f.migrations:  # only then: an uninterrupted request keeps SGLang's exact meta_info shape
        meta["num_migrations"] = f.migrations
    if s.get("deterministic"):  # likewise: batch-invariant decoding (runtime/determinism.py) said when on
        meta["deterministic"] = True
    if f.inp.sampling.logprobs:
        meta.update(_logprobs(f))
    return meta


def _logprobs(f: FinishedRequest) -> dict[str, Any]:
    """meta_info's logprob lists: `[logprob, token id, None]` per token (SGLang's shape)."""
    inp, st = f.inp, f.st
    out: dict[str, Any] = {}
    pd = prompt_logprobs(f)
    if pd is not None and pd.input_logprobs is not None:
        ids = inp.input_ids[inp.sampling.logprob_start_len :]
        out["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(pd.input_logprobs, ids)]
        if inp.sampling.top_logprobs_num > 0 and pd.input_top_logprobs is not None:
            out["input_top_logprobs"] = [
                None if top is None else [[lp, t, None] for t, lp in top] for top in pd.input_top_logprobs
            ]
    out["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(st.logprobs, st.output_ids)]
    if inp.sampling.top_logprobs_num > 0:
        out["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in st.top_logprobs]
    return out


def build_request_trace(f: FinishedRequest, tl: Timeline, meta_info: dict[str, Any]) -> RequestTrace:
    pd, room = f.room.prefill_done, f.room
    return build_trace(
        TraceInput(
            rid=f.inp.rid,
            tl=tl,
            prefill_worker=room.prefill.worker_id if room.prefill is not None else "",
            decode_worker=room.decode.worker_id if room.decode is not None else "",
            prefill_events=pd.events if pd is not None else {},
            prefill_offset=room.leg("prefill").clock.offset,
            forward_chunks=pd.forward_chunks if pd is not None else [],
            decode_events=f.c.decode_events,
            stats=f.c.stats,
            prompt_tokens=f.st.prompt_tokens,
            completion_tokens=len(f.st.output_ids),
            cached_tokens=f.st.cached_tokens,
            migrations=f.migrations,
            meta_info=meta_info,
        )
    )
