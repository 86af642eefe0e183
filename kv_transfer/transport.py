"""The interface both KV transports implement: the pair group (dist_transport.py) and the prefill
node's shared-memory segment (shm_transport.py).

The endpoints' I/O threads (sender_io.py, receiver_io.py) keep every room and handshake, whatever the
transport; they hand a room to its transport once its pages may move. The transport then moves them on
the peer's pair thread (sender_pair.py, receiver_pair.py), in the order rooms were handed over, and
reports through the endpoint's mailbox (mailbox.py): Started and Done on the prefill node, Done on the
decode node.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from pdserve.protocol import kv_control as kc
from pdserve.protocol.kv_trailer import FirstToken

if TYPE_CHECKING:
    from pdserve.kv_transfer.receiver_pair import ReceiverPair
    from pdserve.kv_transfer.sender_pair import SenderPair
    from pdserve.kv_transfer.state import RecvRoom, SendRoom


@dataclass
class SendJob:
    """A room both of whose halves are known, queued on the decode peer's pair thread."""

    room: str
    src_pages: list[int]  # exactly the pages that travel
    dst_pages: list[int]  # where they land on the decode node, same length
    num_tokens: int
    metadata: FirstToken
    transport: SendTransport
    # Set by the I/O thread on abort; checked before the transfer starts.
    cancelled: threading.Event = field(default_factory=threading.Event)
    # The page whose bit the corruption test hook flipped (send_hooks.FaultySend), flipped back at the end.
    flipped: int | None = None


class SendTransport(ABC):
    """How rooms' pages leave this prefill node for a decode peer."""

    # How long a started room may wait for its end (None: the transport always reports Done itself).
    started_timeout_s: float | None = None

    @abstractmethod
    def transfer(self, pair: SenderPair, job: SendJob) -> None:
        """(pair thread) Move the job's pages: post Started once they start to move, then Done when the
        transfer ended (or let the peer's answer end it, within `started_timeout_s`)."""

    def give_up(self, room: SendRoom) -> str:
        """(I/O thread) A started room's `started_timeout_s` ran out: make sure the peer can no longer
        take the pages, which are freed next; why the room failed."""
        return f"timed out after {self.started_timeout_s}s waiting for the decode's end of {room.room}"


J = TypeVar("J")


class ReceiveTransport(ABC, Generic[J]):
    """How rooms' pages reach this decode node from one prefill peer."""

    @abstractmethod
    def accept(self, live: RecvRoom | None, msg: kc.Announce) -> tuple[J | None, str | None]:
        """(I/O thread) The announcement of `msg.room` (`live`: the room waiting for it here, or None):
        the job for the pair thread (None: nothing to run), and why `live` fails (None: it goes on)."""

    @abstractmethod
    def receive(self, pair: ReceiverPair, job: J) -> None:
        """(pair thread) Land the job's pages and post Done (with the trailer's first token on success)."""
