"""The stored responses: bounded by count, bytes and age; one owner's entries invisible to another."""

from __future__ import annotations

import time

from pdserve.gateway.responses_store import ResponseStore, owner_of


def test_entries_belong_to_their_key():
    store = ResponseStore()
    a = owner_of([(b"authorization", b"Bearer key-a")], keyed=True)
    b = owner_of([(b"x-api-key", b"key-b")], keyed=True)
    assert a != b and "key-a" not in a and owner_of([], keyed=False) == "open"
    store.put("r1", a, {"id": "r1"}, [])
    assert store.get("r1", a) is not None
    assert store.get("r1", b) is None and not store.delete("r1", b)
    assert store.delete("r1", a) and store.get("r1", a) is None


def test_the_store_is_bounded_by_count_bytes_and_age():
    store = ResponseStore(max_count=2, max_bytes=10_000, ttl_s=60)
    for i in range(3):
        store.put(f"r{i}", "o", {"id": f"r{i}"}, [])
    assert len(store) == 2 and store.get("r0", "o") is None and store.get("r2", "o") is not None
    store = ResponseStore(max_count=100, max_bytes=300, ttl_s=60)
    for i in range(10):
        store.put(f"r{i}", "o", {"id": f"r{i}", "pad": "x" * 50}, [])
    assert store.bytes <= 300 and store.get("r9", "o") is not None and store.get("r0", "o") is None
    store.put("huge", "o", {"pad": "x" * 1000}, [])  # bigger than the whole store: not kept
    assert store.get("huge", "o") is None
    store = ResponseStore(ttl_s=0.05)
    store.put("old", "o", {}, [])
    time.sleep(0.1)
    assert store.get("old", "o") is None and len(store) == 0
