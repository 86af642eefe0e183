"""The all-reduce of a CPU tensor-parallel worker's ranks through shared memory, instead of gloo's TCP.

A gloo all-reduce over loopback costs ~1 ms whatever its size at decode shapes, and a decode step takes
two per layer (`pdserve bench tp`). The ranks share one host, so they can share the memory: each has a
slot in a segment in /dev/shm (made by rank 0, mode 0600, its name in rank 0's private folder), writes its
partial sums there, raises its sequence number, waits for every rank's, and sums the slots in rank order.
Every rank computes the same sum in the same order: the ranks' results are identical, whatever N.

Two sets of slots alternate between calls: a rank writing call k's partial sums into set k % 2 knows
every rank has finished reading call k-2's, because each had already raised its number for call k-1.
Writes and the sequence numbers are ordinary stores, which x86 keeps in program order (the only host
this path runs on: CPU workers; CUDA ranks use NCCL).

A wait spins, then yields the core (a rank may share it with another), and gives up after `timeout_s`, or
as soon as `alive()` says a rank died: the worker then ends as one unit (tp_group.TPGroupBroken).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import torch

SLOT_BYTES = 8 << 20  # a tensor larger than this goes through gloo
_FLAG_STRIDE = 8  # int64 words between two ranks' sequence numbers: one cache line each
SPIN = 2000  # checks before the first yield


def _total_bytes(size: int) -> int:
    return size * _FLAG_STRIDE * 8 + 2 * size * SLOT_BYTES


def make_segment(path: str, size: int) -> None:
    """Rank 0, before it starts the others: the segment, all zeros (memory only where written)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, _total_bytes(size))
    finally:
        os.close(fd)


class ShmAllReduce:
    def __init__(self, path: str, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        flags_bytes = size * _FLAG_STRIDE * 8
        total = _total_bytes(size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, total, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._flags = raw[:flags_bytes].view(torch.int64).view(size, _FLAG_STRIDE)[:, 0]
        self._slots = raw[flags_bytes:].view(2, size, SLOT_BYTES)
        self._seq = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= SLOT_BYTES

    def all_reduce(self, t: torch.Tensor, alive: Callable[[], bool], timeout_s: float | None) -> None:
        """Sum `t` (contiguous, CPU, at most SLOT_BYTES) over the ranks, in place."""
        self._seq += 1
        seq = self._seq
        nbytes = t.numel() * t.element_size()
        slots = self._slots[seq % 2, :, :nbytes].view(t.dtype)  # [size, numel]
        slots[self.rank].copy_(t.reshape(-1))
        self._flags[self.rank] = seq
        self._wait(seq, alive, timeout_s)
        torch.sum(slots, dim=0, out=t.view(-1))

    def _wait(self, seq: int, alive: Callable[[], bool], timeout_s: float | None) -> None:
        flags = self._flags
        spins = 0
        deadline = None
        while int(flags.min()) < seq:
            spins += 1
            if spins < SPIN:
                continue
            os.sched_yield()
            if spins % 256 == 0:
                now = time.monotonic()
                deadline = deadline or (now + timeout_s if timeout_s is not None else None)
                if not alive():
                    raise ConnectionError("a TP rank died during an all-reduce")
                if deadline is not None and now > deadline:
                    raise TimeoutError(f"a TP rank did not join an all-reduce in {timeout_s:.0f}s")

    def close(self) -> None:
        self._flags = self._slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass
