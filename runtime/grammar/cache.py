"""The compiled-grammar cache: least recently used first out, bounded in entries and in bytes.

A compiled grammar's size grows with its text and its shape: a small JSON schema is tens of KB, but a
100 KB EBNF of chained character-class rules compiles to 50-80 MB over the bundled model's
49152-token vocabulary. A bound on entries alone (256) would let a client that sends distinct large
grammars hold many GB per process; the byte bound evicts the oldest entries first and never keeps a
single entry larger than the whole bound (its request still uses it; nothing else will).

Not thread-safe by itself: the backend holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """An LRU map whose entries each carry a size; at most `max_entries` and `max_bytes` in total."""

    def __init__(self, max_entries: int, max_bytes: int):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a grammar cache needs room for at least one entry and one byte")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.bytes = 0  # sum of the kept entries' sizes
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, nbytes: int) -> bool:
        """Keep `value` as the most recently used, evicting the oldest entries until both bounds hold;
        False (nothing kept, nothing evicted) when it alone is larger than `max_bytes`."""
        if nbytes > self.max_bytes:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (value, nbytes)
        self.bytes += nbytes
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
        return True
