"""The stored responses: bounded by count, bytes and age, per owner and in all; one owner's entries
invisible to another and never evicted by it; the bytes counted are the memory held."""

from __future__ import annotations

import gc
import json
import time
import tracemalloc

from pdserve.gateway.api.responses_store import ResponseStore, StoreLimits, owner_of

BIG = "x" * ((4 << 20) - 100_000)  # what one request under the 4 MiB body limit can carry


def test_entries_belong_to_their_key():
    store = ResponseStore()
    a = owner_of([(b"authorization", b"Bearer key-a")], keyed=True)
    b = owner_of([(b"x-api-key", b"key-b")], keyed=True)
    assert a != b and "key-a" not in a and owner_of([], keyed=False) == "open"
    store.put("r1", a, {"id": "r1"}, [{"role": "user", "content": "hi"}])
    entry = store.get("r1", a)
    assert entry is not None and json.loads(entry.response_json) == {"id": "r1"}
    assert entry.messages() == [{"role": "user", "content": "hi"}]
    assert store.get("r1", b) is None and not store.delete("r1", b)
    assert store.delete("r1", a) and store.get("r1", a) is None and store.usage(a) == (0, 0)


def test_the_store_is_bounded_by_count_bytes_and_age():
    store = ResponseStore(StoreLimits(owner_count=2, max_count=4, ttl_s=60))
    for i in range(3):
        store.put(f"r{i}", "o", {"id": f"r{i}"}, [])
    assert len(store) == 2 and store.get("r0", "o") is None and store.get("r2", "o") is not None
    store = ResponseStore(StoreLimits(owner_bytes=6000, max_bytes=12_000, ttl_s=60))
    for i in range(10):
        store.put(f"r{i}", "o", {"id": f"r{i}", "pad": "x" * 1000}, [])
    assert store.bytes <= 6000 and store.get("r9", "o") is not None and store.get("r0", "o") is None
    store.put("huge", "o", {"pad": "x" * 7000}, [])  # bigger than an owner's quota: not kept
    assert store.get("huge", "o") is None and store.get("r9", "o") is not None
    store = ResponseStore(StoreLimits(ttl_s=0.05))
    store.put("old", "o", {}, [])
    time.sleep(0.1)
    assert store.get("old", "o") is None and len(store) == 0


def test_one_owner_filling_its_quota_evicts_only_its_own():
    """As measured against the gateway: a key storing many responses of 3.9 MiB (the old store, one
    FIFO of 64 MiB for every key, dropped another key's after 17) drops only its own oldest."""
    store = ResponseStore()
    store.put("a1", "key:a", {"id": "a1"}, [{"role": "user", "content": "hi"}])
    for i in range(20):
        store.put(f"b{i}", "key:b", {"id": f"b{i}", "user": BIG}, [])
    assert store.get("a1", "key:a") is not None
    assert store.get("b19", "key:b") is not None and store.get("b0", "key:b") is None
    count, size = store.usage("key:b")
    assert size <= 32 << 20 and count == size // len(BIG)
    assert store.bytes <= 64 << 20


def test_the_global_bound_takes_from_the_biggest_owner():
    """Three owners whose quotas overlap the global bound: the one over it in all loses its own
    oldest, the two holding less keep everything."""
    store = ResponseStore(StoreLimits(owner_count=5, max_count=8, owner_bytes=1 << 20, max_bytes=2 << 20))
    store.put("a", "key:a", {"id": "a"}, [])
    store.put("b1", "key:b", {"id": "b1"}, [])
    store.put("b2", "key:b", {"id": "b2"}, [])
    for i in range(5):
        store.put(f"c{i}", "key:c", {"id": f"c{i}"}, [])
    assert len(store) == 8 and store.usage("key:c")[0] == 5
    store.put("b3", "key:b", {"id": "b3"}, [])  # 9 in all: c holds the most
    assert store.usage("key:c")[0] == 4 and store.get("c0", "key:c") is None
    assert store.get("a", "key:a") is not None and store.get("b1", "key:b") is not None
    # The same in bytes: c's big entries go, a's small one stays.
    store = ResponseStore(StoreLimits(owner_bytes=800_000, max_bytes=1_200_000))
    store.put("a", "key:a", {"id": "a"}, [])
    for i in range(3):
        store.put(f"b{i}", "key:b", {"pad": "x" * 200_000}, [])
    for i in range(3):
        store.put(f"c{i}", "key:c", {"pad": "x" * 250_000}, [])
    assert store.bytes <= 1_200_000 and store.get("a", "key:a") is not None
    assert store.usage("key:b")[0] == 3 and store.get("c2", "key:c") is not None


def _junk(i: int) -> dict:
    return {"id": f"r{i}", "text": {"junk": [[] for _ in range(100_000)]}}


def test_the_size_counted_is_the_memory_held():
    """An empty list is 2 bytes of JSON and 56 of memory: the old store kept the objects and counted
    their JSON, 17x less than it held. Now what is counted bounds what is held."""
    store = ResponseStore()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4):
            store.put(f"r{i}", "o", _junk(i), [{"role": "user", "content": "hi"}])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # (the store's own tables: a few hundred bytes besides the entries)
    assert held <= store.bytes + 4096, (held, store.bytes)
    assert store.bytes < 2 * held + 8192, (held, store.bytes)  # and not far above it
