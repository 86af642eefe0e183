"""Where prefixes live: per prefill worker, the block hashes of the pages its prefix cache holds.

Fed by the worker's `KVEvents` (a snapshot after each registration, then what each step stored and
evicted); read by routing to count how much of a prompt a worker would take from its cache. The
index may lag the worker (events in flight, a missed one until the next snapshot): a stale entry
only makes routing less good, the worker's own cache decides what is reused.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.protocol.block_hash import block_hashes
from pdserve.protocol.gateway import KVEvents


class PrefixIndex:
    def __init__(self) -> None:
        self.page_size: int | None = None  # unknown until the worker's first KVEvents
        self.blocks: set[int] = set()

    def apply(self, ev: KVEvents) -> None:
        if ev.snapshot or ev.page_size != self.page_size:
            self.blocks = set()
        self.page_size = ev.page_size
        self.blocks.update(ev.stored)
        self.blocks.difference_update(ev.removed)

    def cached_tokens(self, input_ids: Sequence[int], hashes: dict[int, list[int]]) -> int:
        """Prompt tokens this worker would take from its cache: the longest run of leading whole
        pages it holds, at most all but the last token (the worker always computes that one).
        `hashes` caches the prompt's block hashes per page size across workers."""
        ps = self.page_size
        if ps is None or not self.blocks:
            return 0
        if ps not in hashes:
            usable = (len(input_ids) - 1) // ps * ps if input_ids else 0
            hashes[ps] = block_hashes(input_ids[:usable], ps)
        n = 0
        for h in hashes[ps]:
            if h not in self.blocks:
                break
            n += 1
        return n * ps
