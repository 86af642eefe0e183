"""What the threads of one endpoint tell its I/O thread: typed mailbox items, and the mailbox itself.

Caller -> I/O thread: Send (sender), Request and Connect (receiver), Abort, Close.
Pair thread -> I/O thread: Outbound (sender) and ToSender (receiver): a control message to the peer;
Started (sender), Done (both; metadata only on the receiver), GroupDead (receiver: tell the sender to
drop a generation).
The I/O thread dispatches on the item's type (`match`); it owns every room, so items carry only values.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
from dataclasses import dataclass

from pdserve.protocol import kv_control as kc
from pdserve.protocol.kv_trailer import FirstToken

# ---- from the caller's thread -----------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Prefill: the prompt of `room` is computed; send its pages once the decode's page list is here."""

    room: str
    src_pages: list[int]
    num_tokens: int
    metadata: FirstToken
    t0: float  # time.monotonic() of the call
    block_hashes: list[int]  # chained hashes of the prompt's whole pages (incremental transfer)


@dataclass(frozen=True)
class Request:
    """Decode: ask the prefill node at `addr` to fill `pages` with room's KV."""

    room: str
    addr: str
    pages: list[int]
    num_tokens: int
    t0: float
    skip_pages: int = 0  # the first pages are here already: `pages` are for the rest
    prefix_hash: int | None = None


@dataclass(frozen=True)
class Connect:
    """Decode: handshake with `addr` now; `future` is resolved when the pair is up or refused."""

    addr: str
    future: concurrent.futures.Future[None]


@dataclass(frozen=True)
class Abort:
    room: str
    reason: str


@dataclass(frozen=True)
class Close:
    """Stop the I/O thread (it closes every pair first)."""


# ---- from a pair's thread ----------------------------------------------------------------------


@dataclass(frozen=True)
class Outbound:
    """Sender pair: send `msg` to the decode peer `identity` (only the I/O thread touches the socket)."""

    identity: bytes
    msg: kc.Message


@dataclass(frozen=True)
class Started:
    """Sender pair: the data of `room` starts moving (on the room's transport)."""

    room: str


@dataclass(frozen=True)
class Done:
    """Pair: the transfer of `room` ended; `error` None means success. `metadata`: receiver only, the
    prefill's first token from the trailer."""

    room: str
    error: str | None
    num_bytes: int = 0
    metadata: FirstToken | None = None
    direct: bool = False  # receiver: pool to pool (page runs), not staged chunks
    shm: bool = False  # receiver: copied out of the sender's shared-memory segment
    corrupt: bool = False  # receiver: the pages landed, but not as the sender hashed them (checksum.py)


@dataclass(frozen=True)
class GroupDead:
    """Receiver pair: generation `gen` of the pair with `addr` is gone; the sender should drop it too."""

    addr: str
    gen: int
    reason: str


@dataclass(frozen=True)
class ToSender:
    """Receiver pair: send `msg` to the prefill node at `addr` (only the I/O thread touches the socket)."""

    addr: str
    msg: kc.Message


Item = Send | Request | Connect | Abort | Close | Outbound | Started | Done | GroupDead | ToSender


class Mailbox:
    """A thread-safe queue whose arrivals wake a zmq.Poller through a pipe (register `fileno`)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        return self._read_fd

    def post(self, item: Item) -> None:
        self._queue.put(item)
        try:
            os.write(self._write_fd, b"\x00")
        except (BlockingIOError, OSError):
            pass  # pipe full (reader already has a wake-up pending) or closed at shutdown

    def drain(self) -> list[Item]:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
