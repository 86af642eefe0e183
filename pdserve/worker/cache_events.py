"""A worker's prefix cache as the gateway sees it: KV events out, flush requests in.

Both roles keep a prefix cache (`runtime/radix_cache.py`) and tell the gateway what it holds, so that
routing can send a prompt where its prefix already lives (`gateway/cluster/prefix_index.py`). At most one
`KVEvents` per worker step: a full snapshot after each (re)registration, since a gateway that
(re)admits a worker knows nothing of its cache, else the block hashes stored and evicted this step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.protocol import gateway as m
from pdserve.worker.link import WorkerLink

if TYPE_CHECKING:
    from pdserve.runtime.radix_cache import RadixCache


class CacheEvents:
    def __init__(self, worker_id: str, role: str, cache: RadixCache | None) -> None:
        self.worker_id, self.role, self.cache = worker_id, role, cache
        self.snapshot_for = 0  # the link's accepted registrations the gateway has had a snapshot for

    def publish(self, link: WorkerLink) -> None:
        if self.cache is None:
            return
        stored, removed = self.cache.take_events()
        ps, wid = self.cache.page_size, self.worker_id
        if link.accepted != self.snapshot_for:
            self.snapshot_for = link.accepted
            snap = self.cache.block_snapshot()
            link.send(m.KVEvents(worker_id=wid, page_size=ps, snapshot=True, stored=snap))
        elif stored or removed:
            link.send(m.KVEvents(worker_id=wid, page_size=ps, stored=stored, removed=removed))

    def flush(self, flush_id: str, in_flight: int) -> m.FlushCacheDone:
        """Empty the cache, only when no request is in flight here (its pages may be cached ones);
        the removal reaches the gateway with the next `publish`."""
        if in_flight:
            why = f"{self.role} worker {self.worker_id} has {in_flight} requests in flight"
            return m.FlushCacheDone(flush_id=flush_id, ok=False, message=why)
        if self.cache is not None:
            try:
                self.cache.flush()
            except RuntimeError as e:
                return m.FlushCacheDone(flush_id=flush_id, ok=False, message=str(e))
        return m.FlushCacheDone(flush_id=flush_id, ok=True)
