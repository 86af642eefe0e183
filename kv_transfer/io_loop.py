"""The I/O thread's loop, shared by both ends: peer frames, mailbox items and timers, in that order.

`EndpointIO` polls its zmq sockets and the mailbox's pipe. Each frame is decoded with the one KV
control codec; a refused frame (another protocol version, a malformed body) goes to `on_refused`
and never stops the loop, nor does an exception in any handler or in reading a socket. A message of the
wrong number of frames is dropped by `peer_of`; a frame over the socket's size limit never arrives (zmq
MAXMSGSIZE drops the connection). Subclasses (the sender's and the
receiver's I/O state) implement the hooks below; `Close` ends the loop.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Generic, TypeVar

import zmq

from pdserve.kv_transfer.mailbox import Close, Item, Mailbox
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError

logger = logging.getLogger("pdserve.kv_transfer")

TICK_S = 0.02  # timer resolution of the I/O thread while a timer may come due
# With nothing in flight the thread sleeps until a frame or a mailbox item, running its timers (slow
# housekeeping only then) at least this often: no wake-ups on cores a forward may be using.
IDLE_TICK_S = 1.0


P = TypeVar("P")  # how a side names a peer: the sender a zmq identity, the receiver its peer record


class EndpointIO(Generic[P]):
    def __init__(self, mailbox: Mailbox) -> None:
        self.mailbox = mailbox
        self.poller = zmq.Poller()
        self.poller.register(mailbox.fileno(), zmq.POLLIN)

    def run(self) -> None:
        while True:
            wait = TICK_S if self.in_flight() else IDLE_TICK_S
            events = dict(self.poller.poll(int(wait * 1000)))
            for sock in [s for s in events if isinstance(s, zmq.Socket)]:
                guarded(self._read, sock)
            for item in self.mailbox.drain():
                if isinstance(item, Close):
                    return
                guarded(self.on_local, item)
            guarded(self.on_timers, time.monotonic())

    def _read(self, sock: zmq.Socket[bytes]) -> None:
        while self.owns(sock):  # a handler may close the socket
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = self.peer_of(sock, frames)
            if peer is None:
                continue
            try:
                msg = kc.decode(frames[-1])
            except ProtocolError as e:
                guarded(self.on_refused, peer, e)
                continue
            guarded(self.on_peer, peer, msg)

    # ---- implemented by each side ---------------------------------------------------------------

    def owns(self, sock: zmq.Socket[bytes]) -> bool:
        raise NotImplementedError

    def peer_of(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> P | None:
        """The peer that sent `frames` on `sock` (None: drop them)."""
        raise NotImplementedError

    def on_peer(self, peer: P, msg: kc.Message) -> None:
        raise NotImplementedError

    def on_refused(self, peer: P, error: ProtocolError) -> None:
        raise NotImplementedError

    def on_local(self, item: Item) -> None:
        raise NotImplementedError

    def on_timers(self, now: float) -> None:
        raise NotImplementedError

    def in_flight(self) -> bool:
        """Whether a timeout may come due within a tick (rooms, handshakes under way)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """After the loop, however it ended: say Bye to every peer and close the pairs."""
        raise NotImplementedError


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
            address: str = probe.getsockname()[0]
            return address
        except OSError:
            return "::1" if family == socket.AF_INET6 else "127.0.0.1"


def guarded(handler: Any, *args: Any) -> None:
    """Run one I/O-thread event handler; a bug in one event must not stop the engine's thread."""
    try:
        handler(*args)
    except Exception:  # noqa: BLE001
        logger.exception("kv_transfer: error handling %s", args[:1])
