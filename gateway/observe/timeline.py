"""Stitch one request's timeline from three clocks onto the gateway's (pure functions).

Each worker reports event times on its own clock; `offset` (worker - gateway, see clock.py) maps
them over. Offsets carry an error of up to rtt / 2, so the mapped times are then clamped to what
causality guarantees:

  request_received <= dispatch_finish <= forward_entry <= prefill_finished <= first_token
  <= request_finished <= response_sent

and no event is later than the gateway's receipt of the message that carried it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pdserve.protocol.records import DecodeEvents, PrefillEvents


@dataclass(frozen=True)
class TimelineInput:
    # Gateway clock.
    request_received: float
    dispatch_finished: float
    first_token_recv: float  # receipt of the first output carrying tokens
    final_recv: float  # receipt of the output that finished the request
    response_sent: float
    prefill_done_recv: float | None  # None: PrefillDone never arrived
    # Worker clocks.
    prefill_events: PrefillEvents
    prefill_offset: float
    decode_events: DecodeEvents
    decode_offset: float
    completion_tokens: int


@dataclass(frozen=True)
class Timeline:
    request_received_ts: float
    api_server_dispatch_finish_ts: float
    forward_entry_time: float
    prefill_finished_time: float
    first_token_ts: float
    request_finished_ts: float
    response_sent_to_client_ts: float
    queue_time: float  # a duration on the prefill clock (no offset involved)

    @property
    def first_token_latency(self) -> float:
        return self.first_token_ts - self.request_received_ts

    @property
    def e2e_latency(self) -> float:
        return self.request_finished_ts - self.request_received_ts


def clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), max(lo, hi))


def stitch(t: TimelineInput) -> Timeline:
    def prefill(name: Literal["forward_entry", "prefill_finished"]) -> float | None:
        v = t.prefill_events.get(name)
        return None if v is None else v - t.prefill_offset

    def decode(name: Literal["kv_ready", "finished"]) -> float | None:
        v = t.decode_events.get(name)
        return None if v is None else v - t.decode_offset

    received = t.request_received
    dispatched = max(t.dispatch_finished, received)
    first = max(t.first_token_recv, dispatched)
    # Prefill events were carried by PrefillDone, and the first token cannot precede them.
    prefill_hi = min(first, t.prefill_done_recv if t.prefill_done_recv is not None else math.inf)
    fe = prefill("forward_entry")
    forward_entry = clamp(fe if fe is not None else dispatched, dispatched, prefill_hi)
    pf = prefill("prefill_finished")
    if pf is None:
        # Without PrefillDone, the decode's "KV arrived" is the closest witness.
        pf = decode("kv_ready")
    prefill_finished = clamp(pf if pf is not None else prefill_hi, forward_entry, prefill_hi)
    first = max(first, prefill_finished)
    final_recv = max(t.final_recv, first)
    fin = decode("finished")
    finished = clamp(fin if fin is not None else final_recv, first, final_recv)
    sent = max(t.response_sent, finished)

    qe, fe_raw = t.prefill_events.get("queue_entry"), t.prefill_events.get("forward_entry")
    queue_time = max(0.0, fe_raw - qe) if qe is not None and fe_raw is not None else 0.0
    return Timeline(
        request_received_ts=received,
        api_server_dispatch_finish_ts=dispatched,
        forward_entry_time=forward_entry,
        prefill_finished_time=prefill_finished,
        first_token_ts=first,
        request_finished_ts=finished,
        response_sent_to_client_ts=sent,
        queue_time=queue_time,
    )


def decode_throughput(completion_tokens: int, first_token_ts: float, finished_ts: float) -> float:
    """Tokens after the first, per second of decoding; 0 when undefined."""
    span = finished_ts - first_token_ts
    if completion_tokens <= 1 or span <= 0:
        return 0.0
    return (completion_tokens - 1) / span


def spec_accept_rate(correct: int, proposed: int) -> float:
    return correct / proposed if proposed > 0 else 0.0


def spec_accept_length(completion_tokens: int, verify_ct: int) -> float:
    """Tokens per verify forward, as SGLang reports it."""
    return completion_tokens / verify_ct if verify_ct > 0 else 0.0
