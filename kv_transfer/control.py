"""Control plane of the KV hand-off: pyzmq messages between a receiver's DEALER and a sender's ROUTER.

Every message is one JSON frame {"t": <type>, ...}. Messages (r = receiver/decode, s = sender/prefill):
  HELLO     r->s  receiver_id, identity               handshake; s compares identities
  HELLO_ACK s->r  ok, error, store_port, gen           r builds the pair group `gen` on success
  REQUEST   r->s  room, pages, num_tokens              the decode's pre-allocated page list
  ANNOUNCE  s->r  room, seq, gen, num_pages, chunk_pages, runs, trailer_len, num_tokens
                                                       data for `room` follows on the pair group:
                                                       staged chunks, or pool-to-pool runs if given
  BUILD     s->r  gen                                  rebuild the pair group under generation `gen`
  PAIR_DEAD r->s  gen, reason                          the receiver discarded generation `gen`
  ABORT     both  room, reason                         the other side gave up on `room`
  BYE       both  reason                               the pair is closed (eviction, shutdown)
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("pdserve.kv_transfer")

HELLO = "hello"
HELLO_ACK = "hello_ack"
REQUEST = "request"
ANNOUNCE = "announce"
BUILD = "build"
PAIR_DEAD = "pair_dead"
ABORT = "abort"
BYE = "bye"


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"t": kind, **fields}).encode()


def decode(frame: bytes) -> dict[str, Any]:
    msg = json.loads(frame.decode())
    if not isinstance(msg, dict) or "t" not in msg:
        raise ValueError(f"malformed control message: {frame[:200]!r}")
    return msg


class Mailbox:
    """A thread-safe queue whose arrivals wake a zmq.Poller through a pipe (register `fileno`)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        return self._read_fd

    def post(self, item: Any) -> None:
        self._queue.put(item)
        try:
            os.write(self._write_fd, b"\x00")
        except (BlockingIOError, OSError):
            pass  # pipe full (reader already has a wake-up pending) or closed at shutdown

    def drain(self) -> list[Any]:
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


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def local_address_towards(host: str) -> str:
    """The local IP the kernel would use to reach `host` (no packet is sent: UDP connect only routes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "::1" if family == socket.AF_INET6 else "127.0.0.1"


def guarded(handler: Callable[..., None], *args: Any) -> None:
    """Run one I/O-thread event handler; a bug in one event must not stop the engine's thread."""
    try:
        handler(*args)
    except Exception:  # noqa: BLE001
        logger.exception("kv_transfer: error handling %s", args[:1])
