"""The pair groups' rendezvous store (kv_transfer/pair_store.py): two copies joined by messages, no port.

A real gloo group is built over two PairStores whose writes reach each other only through `deliver`
(as the bootstrap channel carries them), and moves a tensor; a peer cannot put more than the bounds in;
a key that never comes is a timeout, not a hang."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from pdserve.kv_transfer.pair_store import MAX_KEYS, MAX_VALUE_BYTES, PairStore, PairStores

T = timedelta(seconds=10)


def _joined(gen: int = 0) -> tuple[PairStores, PairStores, list[tuple[str, int, str]]]:
    """Two sides whose published keys are delivered to each other; the log of what crossed."""
    crossed: list[tuple[str, int, str]] = []
    sides: dict[str, PairStores] = {}

    def publisher(me: str, other: str):
        def publish(g: int, key: str, value: bytes) -> None:
            crossed.append((me, g, key))
            sides[other].deliver(g, key, value)

        return publish

    sides["a"] = PairStores(publisher("a", "b"), T)
    sides["b"] = PairStores(publisher("b", "a"), T)
    return sides["a"], sides["b"], crossed


def test_a_gloo_group_meets_through_pair_stores():
    a, b, crossed = _joined()
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int, stores: PairStores) -> None:
        try:
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = T
            opts._threads = 1
            opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            store = stores.for_gen(5)
            pg = ProcessGroupGloo(PrefixStore("pair/x/5", store), r, 2, opts)
            t = torch.arange(8, dtype=torch.float32) * (r + 1)
            if r == 0:
                pg.send([t], 1, 0).wait()
            else:
                pg.recv([t], 0, 0).wait()
            got[r] = t
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r, s)) for r, s in ((0, a), (1, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert torch.equal(got[1], torch.arange(8, dtype=torch.float32))
    # Each rank published its own address key once, under generation 5.
    assert sorted((side, gen) for side, gen, _ in crossed) == [("a", 5), ("b", 5)]


def test_a_peer_cannot_fill_the_store():
    store = PairStore(0, lambda *_: None, T)
    for i in range(MAX_KEYS):
        assert store.deliver(f"k{i}", b"x")
    assert not store.deliver("one-more", b"x")
    assert store.deliver("k0", b"overwrite")  # an existing key may change
    assert not PairStore(0, lambda *_: None, T).deliver("big", b"x" * (MAX_VALUE_BYTES + 1))
    stores = PairStores(lambda *_: None, T)
    for gen in range(100):
        stores.deliver(gen, "k", b"v")
    assert len(stores._by_gen) <= 4  # only the latest generations are kept


def test_a_missing_key_times_out():
    store = PairStore(0, lambda *_: None, timedelta(seconds=0.2))
    with pytest.raises(TimeoutError, match="no value for"):
        store.get("never")
    store.set("k", b"v")
    assert store.get("k") == b"v" and store.check(["k"]) and not store.check(["k", "never"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
