"""One finished request's spans and phases on the gateway's clock (pure functions).

Built at the request's end from what the gateway already holds: the stitched `Timeline` (timeline.py)
and the workers' event records, each mapped over with its worker's clock offset (clock.py), then
clamped so that every child span lies inside its parent and after what caused it. The same record
feeds the OpenTelemetry export (tracing.py) and the dashboard (dashboard.py); neither sees prompt or
output text.

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

from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.timeline import Timeline, clamp
from pdserve.protocol.records import DecodeEvents, PrefillEvents, RequestStats

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
    decode_events: DecodeEvents  # already on the gateway clock (generation._Collector)
    stats: RequestStats
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    migrations: int
    meta_info: dict[str, Any]


def build_trace(t: TraceInput) -> RequestTrace:
    tl, off = t.tl, t.prefill_offset
    received, dispatched = tl.request_received_ts, tl.api_server_dispatch_finish_ts
    fe, pf, first = tl.forward_entry_time, tl.prefill_finished_time, tl.first_token_ts
    fin, sent = tl.request_finished_ts, tl.response_sent_to_client_ts

    qe_raw = t.prefill_events.get("queue_entry")
    queue_entry = clamp(qe_raw - off if qe_raw is not None else dispatched, dispatched, fe)
    kr = t.decode_events.get("kv_ready")
    kv_ready = clamp(kr if kr is not None else pf, pf, fin)
    de = t.decode_events.get("decode_entry")
    decode_entry = clamp(de if de is not None else dispatched, dispatched, kv_ready)
    kq = t.decode_events.get("kv_requested")
    kv_requested = clamp(kq if kq is not None else decode_entry, decode_entry, kv_ready)

    worker_p = t.prefill_worker or t.decode_worker
    spans = [SpanRecord("prefill.queue", queue_entry, fe, {"pdserve.worker": worker_p})]
    chunks = t.forward_chunks or [(fe + off, pf + off)]
    for i, (s, e) in enumerate(chunks):
        cs = clamp(s - off, fe, pf)
        spans.append(
            SpanRecord(
                "prefill.forward",
                cs,
                clamp(e - off, cs, pf),
                {"pdserve.worker": worker_p, "pdserve.chunk": i},
            )
        )
    path = str(t.stats.get("kv_path", "local" if not t.prefill_worker else "unknown"))
    nbytes = int(t.stats.get("transfer_bytes", 0))
    transfer = {"pdserve.kv.bytes": nbytes, "pdserve.kv.path": path}
    spans.append(SpanRecord("kv_transfer.send", pf, kv_ready, {"pdserve.worker": worker_p, **transfer}))
    spans.append(
        SpanRecord("decode.admission", decode_entry, kv_requested, {"pdserve.worker": t.decode_worker})
    )
    spans.append(
        SpanRecord(
            "kv_transfer.recv", kv_requested, kv_ready, {"pdserve.worker": t.decode_worker, **transfer}
        )
    )
    s = t.stats
    spans.append(
        SpanRecord(
            "decode",
            kv_ready,
            fin,
            {
                "pdserve.worker": t.decode_worker,
                "pdserve.completion_tokens": t.completion_tokens,
                "pdserve.spec.verify_ct": int(s.get("spec_verify_ct", 0)),
                "pdserve.spec.num_proposed_drafts": int(s.get("spec_num_proposed_drafts", 0)),
                "pdserve.spec.num_correct_drafts": int(s.get("spec_num_correct_drafts", 0)),
                "pdserve.num_retractions": int(s.get("num_retractions", 0)),
            },
        )
    )
    spans.append(SpanRecord("response", fin, sent, {}))
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
        spans=spans,
        attributes=attributes,
        meta_info=t.meta_info,
        prompt_tokens=t.prompt_tokens,
        cached_tokens=t.cached_tokens,
    )
