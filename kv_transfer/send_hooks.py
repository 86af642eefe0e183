"""What a KV sender's transports call at two points of each transfer, for the test hooks to act there.

A serving sender has `SendHooks`, which does nothing: no transfer consults a hook value. A worker
started with `--test-stall-kv-data` or `--test-corrupt-kv` (pdserve/worker/test_hooks.py) gives its
sender `FaultySend` instead, which stalls each announced transfer's data, or flips a bit of the first
rooms' last page after it was hashed (as a wire, a segment or an early reuse would change it) and
flips it back once the room's transfer ended, so that the prefill node's own prefix cache stays intact.
"""

from __future__ import annotations

import threading
import time

import torch


class SendHooks:
    """The hooks of a serving sender: none."""

    def before_data(self) -> None:
        """(pair thread) The transfer was announced; its data is about to move."""

    def corrupt(self, kv: torch.Tensor, pages: list[int]) -> int | None:
        """(pair thread) The pages were hashed: the page changed behind the hashes' back, or None."""
        return None

    def restore(self, kv: torch.Tensor, page: int | None) -> None:
        """The room's transfer ended: undo `corrupt`'s change to `page`."""


class FaultySend(SendHooks):
    """Test hooks: each transfer's data held back `stall_data_s` after its announcement (the peer's
    per-operation timeout must fire); the first `corrupt_rooms` rooms sent (one count shared by both
    transports) corrupted after hashing."""

    def __init__(self, stall_data_s: float = 0.0, corrupt_rooms: int = 0) -> None:
        self._stall_s = stall_data_s
        self._left = corrupt_rooms
        self._lock = threading.Lock()

    def before_data(self) -> None:
        if self._stall_s > 0:
            time.sleep(self._stall_s)

    def corrupt(self, kv: torch.Tensor, pages: list[int]) -> int | None:
        """Flip a bit of `pages[-1]` if rooms are left to corrupt; the page flipped, or None."""
        with self._lock:
            if self._left <= 0 or not pages:
                return None
            self._left -= 1
        _flip(kv, pages[-1])
        return pages[-1]

    def restore(self, kv: torch.Tensor, page: int | None) -> None:
        if page is not None:
            _flip(kv, page)


def _flip(kv: torch.Tensor, page: int) -> None:
    byte = kv[page].view(torch.uint8).view(-1)[:1]
    byte ^= 1
