"""Requests that made a worker's step raise (`RequestFailed` with code `internal`), remembered.

The worker fails such a request and goes on (pdserve/worker/step_faults.py); the gateway answers it 500 and
does not run it again elsewhere, since the fault goes with the request, not the worker. A request
whose fingerprint (prompt ids and sampling parameters) failed that way `REFUSE_AFTER` times is
refused before dispatch (422), so that one client cannot keep costing the workers failed steps. The
record is bounded: the least recently failed fingerprints are forgotten first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from pdserve.sampling_params import SamplingParams

REFUSE_AFTER = 2
CAPACITY = 4096


def request_fingerprint(input_ids: list[int], sampling: SamplingParams) -> str:
    """What makes two requests the same for a worker: the prompt's ids and the sampling parameters."""
    h = hashlib.blake2b(digest_size=16)
    h.update(",".join(map(str, input_ids)).encode())
    h.update(b"|")
    h.update(sampling.model_dump_json().encode())
    return h.hexdigest()


class FailedRequests:
    """Fingerprint -> internal failures, least recently failed first; at most `capacity` entries."""

    def __init__(self, refuse_after: int = REFUSE_AFTER, capacity: int = CAPACITY) -> None:
        self.refuse_after, self.capacity = refuse_after, capacity
        self._failures: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def record(self, fingerprint: str) -> int:
        """One more internal failure of this request; returns its count."""
        n = self._failures.pop(fingerprint, 0) + 1
        self._failures[fingerprint] = n
        while len(self._failures) > self.capacity:
            self._failures.popitem(last=False)
        return n

    def refused(self, fingerprint: str) -> bool:
        return self._failures.get(fingerprint, 0) >= self.refuse_after
