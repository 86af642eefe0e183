"""A worker's KV pools moved into shared memory (kv_transfer/shm.py), for same-host peers to map.

One `SharedPools` per runner owns the segments: made at the first `share`, given memory as the
allocator first hands pages out (or the pages are refused), removed at `close`; the KV senders built
on them only fence them. A TP worker's other ranks each get a segment too (runtime/tensor_parallel.py).
"""

from __future__ import annotations

from pdserve.kv_transfer.shm import SharedSegment, shared_pool
from pdserve.runtime.kv_pool import KVPool, PageAllocator
from pdserve.runtime.tensor_parallel import TensorParallel


class SharedPools:
    def __init__(self) -> None:
        self.segments: list[SharedSegment] = []

    def share(
        self, pool: KVPool, allocator: PageAllocator, tp: TensorParallel, directory: str
    ) -> list[SharedSegment]:
        """Move `pool` (rank 0's) and the other ranks' pools into segments in `directory`; returns them,
        rank 0's first. Called again, it returns the same segments."""
        if self.segments:
            return list(self.segments)
        used = allocator.high_water
        segment, shared = shared_pool(pool.kv, directory, used)
        try:
            segments = [segment, *tp.share_pools(shared, directory, used)]
        except BaseException:
            segment.close()
            raise
        pool.kv = shared
        self.segments = segments
        page_bytes = shared[0].nbytes
        allocator.on_grow = lambda top: all(seg.commit(top * page_bytes) for seg in segments)
        return list(segments)

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
        self.segments = []
