"""A request's vocabulary: why a leg failed, why a leg is aborted, how a request finished.

The values are the strings on the wire and in metrics labels; the types are what the code passes around,
so that go-to-definition leads here from every place that fails, aborts or finishes a request.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from typing_extensions import TypedDict  # pydantic validates only this one below Python 3.12


class FailCode(StrEnum):
    """`RequestFailed.code` (a worker's leg failed), and the failures the gateway itself detects.

    What the client gets for each is the gateway's `FAIL_STATUS` table (gateway/errors.py)."""

    # Sent by workers.
    BAD_REQUEST = "bad_request"  # the request cannot run here (too long, a grammar that fails)
    DEADLINE = "deadline"  # past GenerateRequest.deadline_s
    DRAINING = "draining"  # the worker is leaving rotation: run again elsewhere
    TRANSFER = "transfer"  # the KV transfer failed: run again elsewhere
    # The KV landed but differs from what the prefill node hashed (kv_transfer/checksum.py): never
    # decoded; run again elsewhere, as a failed transfer.
    KV_CORRUPT = "kv_corrupt"
    OOM = "oom"  # no room for the request's KV
    # An exception while the worker computed for this request (pdserve/step_faults.py): the request
    # failed, the worker goes on. Not run again elsewhere: the gateway refuses it after two.
    INTERNAL = "internal"
    # Detected by the gateway.
    WORKER_LOST = "worker_lost"  # the worker missed its heartbeats or disconnected
    SHUTDOWN = "shutdown"  # the gateway is shutting down
    CLIENT_ABORT = "client_abort"  # /abort_request named the request
    ABORTED = "aborted"  # the decode leg finished with an abort (retracted past its limit, say)


class AbortReason(StrEnum):
    """`AbortRequest.reason`: why the gateway stops a leg (also the label of the aborted-legs metric)."""

    CANCELLED = "cancelled"  # the request ended before this leg did (client gone, error on the way)
    OTHER_LEG_FAILED = "other leg failed"
    STOP = "stop"  # a stop string matched before the decode finished
    FINISHED = "finished"  # the prefill's first token finished the request
    DECODE_ENDED = "decode leg ended"  # the decode leg ended before the prefill reported


class LengthFinish(TypedDict):
    type: Literal["length"]
    length: int


class StopFinish(TypedDict):
    type: Literal["stop"]
    matched: int | str | None  # the stop token id, the stop string, or None (EOS by default)


class AbortFinish(TypedDict):
    type: Literal["abort"]
    message: str


class DeadEndFinish(TypedDict):
    """No token can continue the request's grammar (runtime/grammar/matcher.py)."""

    type: Literal["grammar_dead_end"]
    message: str


# `meta_info.finish_reason` and `TokenOutput.finish_reason`, SGLang's shape.
FinishReason = LengthFinish | StopFinish | AbortFinish | DeadEndFinish


def finish_length(length: int) -> LengthFinish:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str | None) -> StopFinish:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str) -> AbortFinish:
    return {"type": "abort", "message": message}


def finish_dead_end() -> DeadEndFinish:
    return {"type": "grammar_dead_end", "message": "no token can continue the grammar"}
