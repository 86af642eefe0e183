"""Event times and counters that travel inside messages: the keys both ends agree on, declared once.

They are TypedDicts: plain JSON objects on the wire and plain dicts in memory (a worker builds them
event by event), with every key named and typed here. Pydantic validates them inside a message, so
a misspelled or mistyped key is refused at decode instead of silently missing at the gateway.
"""

from __future__ import annotations

from pydantic import ConfigDict
from typing_extensions import TypedDict  # pydantic needs typing_extensions' TypedDict before 3.12

_STRICT = ConfigDict(extra="forbid")


class PrefillEvents(TypedDict, total=False):
    """Prefill worker-clock times (epoch seconds), carried by PrefillDone."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    queue_entry: float  # GenerateRequest admitted
    forward_entry: float  # first forward of the prompt started
    prefill_finished: float  # first token sampled (the KV is handed to the sender next)


class DecodeEvents(TypedDict, total=False):
    """Decode worker-clock times (epoch seconds), carried by the first and the final TokenOutput."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    decode_entry: float  # GenerateRequest admitted
    kv_requested: float  # pages allocated, the KV asked of the prefill node (admission ended)
    kv_ready: float  # the prompt's KV and first token arrived
    finished: float  # the request finished


class RequestStats(TypedDict, total=False):
    """Per-request counters, carried by the final TokenOutput (and the offline engine's outputs)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]

    cached_tokens: int
    num_retractions: int
    # Decode worker: KV bytes that came over the transfer (0 for a local prefill), and how many
    # prompt tokens were taken from its own prefix cache instead (incremental transfer).
    transfer_bytes: int
    decode_cached_tokens: int
    # How the prompt's KV reached the decode worker: "<backend>/<direct|staged>" ("gloo/direct": pool to
    # pool in page runs; "staged": through gather/scatter chunks), or "local" (computed on the decode
    # worker, conditional disaggregation).
    kv_path: str
    # Speculative decoding (SGLang's meta_info names): verify forwards, drafts proposed and accepted,
    # and how many verify forwards accepted 0, 1, ..., k drafts.
    spec_verify_ct: int
    spec_num_proposed_drafts: int
    spec_num_correct_drafts: int
    spec_correct_drafts_histogram: list[int]
    # Whether the decode worker (and its prefill pair: the handshake compares it) computed the request
    # batch-invariantly (runtime/determinism.py).
    deterministic: bool
