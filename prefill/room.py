"""What the prefill worker holds for one room, from admission until it leaves the node."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.records import PrefillEvents
from pdserve.runtime.request import Request


@dataclass
class PrefillRoom:
    """One request on the prefill worker: queued, prefilling or transferring."""

    request: Request
    events: PrefillEvents
    # No decode leg (the request asks at most one token): PrefillDone alone answers it.
    alone: bool
    chunks: list[tuple[float, float]] = field(default_factory=list)  # each forward's (start, end)
    # Failed (deadline, internal error) and reported while its transfer is being stopped: the end of
    # that transfer retires it without a second report.
    reported: bool = False
