"""What the in-process KV transfer tests share: a fingerprint, random pools and waiting for results."""

from __future__ import annotations

import os
import time

import torch

FP = {"architecture": "TestLM", "page_size": 4, "weights_hash": "h"}


def random_pool(pages: int, seed: int) -> torch.Tensor:
    """A KV pool of `pages` pages: 2 layers, K and V, 4 tokens a page, 2 heads of 8 ([N,L,2,P,H,D])."""
    return torch.randn(pages, 2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(seed))


def wait_results(engine, rooms: set[str], timeout: float = 10.0) -> dict:
    """The results `engine.poll()` reports for `rooms`, by room; fails if any is missing at the timeout."""
    got, deadline = {}, time.monotonic() + timeout
    while set(got) != rooms and time.monotonic() < deadline:
        got.update({r.room: r for r in engine.poll()})
        time.sleep(0.005)
    assert set(got) == rooms, f"missing results for {rooms - set(got)}"
    return got


class EnginePairs:
    """Makes (sender, receiver) pairs in this process (real zmq sockets and gloo pair groups; with `shm`,
    the sender's pool in shared memory, which the receiver maps) and closes them all in `close()`."""

    def __init__(self) -> None:
        self._made: list = []
        self._paths: list[str] = []

    def __call__(self, sender_config, receiver_config=None, shm: bool = False, hooks=None):
        """`hooks`: the sender's test hooks (kv_transfer/send_hooks.py)."""
        from pdserve.kv_transfer import KVReceiver, KVSender
        from pdserve.kv_transfer.shm import shared_pool

        segment, kv = None, random_pool(32, 1)
        if shm:
            segment, kv = shared_pool(kv)
            self._paths.append(segment.path)
        sender = KVSender(kv, FP, "127.0.0.1", 0, sender_config, segment=segment, hooks=hooks)
        sender.start()
        self._made.append(sender)
        receiver = KVReceiver(random_pool(32, 2), FP, receiver_config or sender_config)
        receiver.start()
        self._made.append(receiver)
        return sender, receiver

    def close(self) -> None:
        """Close every engine; a shared segment must be gone with its sender."""
        for engine in self._made:
            engine.close()
        for path in self._paths:
            assert not os.path.exists(path), path
