"""The pair groups' rendezvous store, carried on the pair's own control channel.

torch.distributed groups meet through a key-value store: each rank publishes its address (gloo) or
the communicator id (NCCL) and reads its peer's. torch's TCPStore is a listening socket that anyone
who reaches it may read and write, with no way to authenticate. A pair has only two ranks, which
already talk over the bootstrap channel (CurveZMQ when the cluster has a secret), so `PairStore`
keeps one copy of the keys on each side and sends every `set` to the other side as a `StoreSet`
message on that channel. No store port is opened: joining a pair group takes the same proof as
talking to the bootstrap socket.

Two copies, no server: `set`, `get`, `wait`, `check`, `multi_get`/`multi_set` and `delete_key` behave
as on any store (a key's last writer wins; both ranks write disjoint keys in practice). `add` and
`compare_set` are applied locally and the result published, which is atomic only when a key is
written from one side, as the group backends do. What a peer may put in is bounded (`MAX_KEYS`,
`MAX_VALUE_BYTES`); a `get` or `wait` gives up after the store's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch._C._distributed_c10d import Store

log = logging.getLogger("pdserve.kv_transfer")

MAX_KEYS = 16  # per pair generation (a gloo pair uses 2, NCCL 1)
MAX_VALUE_BYTES = 4096  # a gloo address is ~170 bytes, an NCCL id 128
_GENERATIONS_KEPT = 4

Publish = Callable[[int, str, bytes], None]  # (gen, key, value) -> the peer


class PairStore(Store):
    """One side's copy of one pair generation's keys; `deliver` is called with the peer's writes."""

    def __init__(self, gen: int, publish: Publish, timeout: timedelta) -> None:
        super().__init__()
        self.gen = gen
        self._publish = publish
        self._timeout = timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    # ---- the peer's writes (I/O thread) -------------------------------------------------------

    def deliver(self, key: str, value: bytes) -> bool:
        """Store a key the peer set; False (and nothing stored) past the bounds."""
        with self._cond:
            if len(value) > MAX_VALUE_BYTES or (key not in self._data and len(self._data) >= MAX_KEYS):
                return False
            self._data[key] = value
            self._cond.notify_all()
        return True

    # ---- the c10d Store interface (the pair thread, inside torch) --------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        with self._cond:
            self._data[key] = data
            self._cond.notify_all()
        self._publish(self.gen, key, data)

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._cond:
            return self._data[key]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (
            timeout if timeout is not None and timeout.total_seconds() > 0 else self._timeout
        ).total_seconds()
        deadline = time.monotonic() + limit
        with self._cond:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if k not in self._data]
                    raise TimeoutError(f"pair store: no value for {missing} within {limit:g} s")
                self._cond.wait(left)

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
        self.set(key, str(value).encode())
        return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        with self._cond:
            current = self._data.get(key)
        if (current is None and not want) or current == want:
            self.set(key, new)
            return new
        return current if current is not None else want

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def items(self) -> list[tuple[str, bytes]]:
        """A snapshot of the keys and values (both sides' writes)."""
        with self._cond:
            return list(self._data.items())

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def clone(self) -> PairStore:
        return self  # one object shared by the threads of a group: every method takes the lock

    def has_extended_api(self) -> bool:
        return False


class PairStores:
    """The stores of one pair's recent generations, made on first use by either side's traffic."""

    def __init__(self, publish: Publish, timeout: timedelta) -> None:
        self._publish = publish
        self._timeout = timeout
        self._lock = threading.Lock()
        self._by_gen: dict[int, PairStore] = {}

    def for_gen(self, gen: int) -> PairStore:
        with self._lock:
            store = self._by_gen.get(gen)
            if store is None:
                store = self._by_gen[gen] = PairStore(gen, self._publish, self._timeout)
                for old in sorted(self._by_gen)[:-_GENERATIONS_KEPT]:
                    del self._by_gen[old]
            return store

    def deliver(self, gen: int, key: str, value: bytes) -> None:
        """A `StoreSet` from the peer; one for a generation long gone is dropped."""
        with self._lock:
            if self._by_gen and gen < min(self._by_gen) and len(self._by_gen) >= _GENERATIONS_KEPT:
                return
        if not self.for_gen(gen).deliver(key, value):
            log.warning(
                "kv_transfer: dropped a pair store key past the limits (gen %d, %d bytes)", gen, len(value)
            )
