"""What the decode worker holds for one room beside its request (which the scheduler holds), from
admission until it leaves the node."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.records import DecodeEvents, PrefillEvents


@dataclass
class DecodeRoom:
    events: DecodeEvents
    prefill_addr: str  # its prefill node's bootstrap address ("" for a local prefill)
    # A local prefill's times, until the first output carries them.
    prefill_events: PrefillEvents | None = None
    transfer_bytes: int = 0  # KV bytes its transfer moved
    kv_pages: list[int] = field(default_factory=list)  # the pages its transfer writes
    # How its KV came: "gloo/direct", "nccl/staged", "shm"... or "local" (RequestStats.kv_path).
    kv_path: str = "local"
    # Aborted or failed while its transfer is being stopped: dropped at its end, whatever that is.
    dropped: bool = False
