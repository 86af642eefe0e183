"""Transfer state machine shared by sender and receiver: states, legal transitions, results.

Sender:   [send() + page list known] BOOTSTRAPPING (pair group being built) -> TRANSFERRING -> SUCCESS
          [send() before page list]  WAITING_FOR_INPUT -> BOOTSTRAPPING/TRANSFERRING -> ...
Receiver: request() -> BOOTSTRAPPING (handshake) -> WAITING_FOR_INPUT (page list sent, waiting for the
          data) -> TRANSFERRING (receiving) -> SUCCESS
Any non-terminal state may go to FAILED (timeout, abort, peer failure, mismatch). Only the owning
engine's I/O thread calls `transition`, so rooms need no lock.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from typing_extensions import TypedDict, Unpack

from pdserve.protocol.kv_trailer import FirstToken

if TYPE_CHECKING:
    from pdserve.kv_transfer.transport import SendJob, SendTransport


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


_TERMINAL = frozenset({TransferState.SUCCESS, TransferState.FAILED})
_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    TransferState.BOOTSTRAPPING: frozenset(
        {TransferState.WAITING_FOR_INPUT, TransferState.TRANSFERRING, TransferState.FAILED}
    ),
    TransferState.WAITING_FOR_INPUT: frozenset(
        {TransferState.BOOTSTRAPPING, TransferState.TRANSFERRING, TransferState.FAILED}
    ),
    TransferState.TRANSFERRING: frozenset({TransferState.SUCCESS, TransferState.FAILED}),
    TransferState.SUCCESS: frozenset(),
    TransferState.FAILED: frozenset(),
}


@dataclass
class TransferResult:
    """What poll() returns once per finished room. On FAILED, `error` says why; free the pages then.

    metadata: the prefill's first token (receiver, SUCCESS only). num_bytes: KV bytes moved. seconds: from
    send() (sender) or request() (receiver) to the result.
    """

    room: str
    state: TransferState
    metadata: FirstToken | None
    error: str | None
    num_bytes: int
    seconds: float
    # Receiver, FAILED only: the prefill node refused the skipped prefix (incremental transfer); the
    # room may be requested again with a full page list.
    prefix_mismatch: bool = False
    # Receiver, SUCCESS: the pages came pool to pool (page runs) rather than through staging chunks.
    direct: bool = False
    # Receiver, SUCCESS: the pages were copied out of the prefill node's shared memory (same host).
    shm: bool = False
    # Receiver, FAILED: the pages landed but differ from the sender's checksums (kv_transfer/checksum.py).
    corrupt: bool = False


class Outcome(TypedDict, total=False):
    """What a finished room reports beside its state and error (the fields of TransferResult)."""

    metadata: FirstToken | None
    num_bytes: int
    prefix_mismatch: bool
    direct: bool
    shm: bool
    corrupt: bool


R = TypeVar("R", bound="TransferRoom")


@dataclass
class TransferRoom:
    """One room's state on one side. `deadline` is a time.monotonic() value or None (no timer)."""

    room: str
    state: TransferState
    started: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    aborted: bool = False

    @classmethod
    def enter(
        cls: type[R], room: str, state: TransferState, timeout_s: float | None, started: float, **fields: Any
    ) -> R:
        """A new room in its first state, with a timer of timeout_s seconds (None: no timer)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return cls(room=room, state=state, started=started, deadline=deadline, **fields)

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL

    def transition(self, new: TransferState, timeout_s: float | None = None) -> None:
        """Move to `new`; arm a timer of `timeout_s` seconds for the new state (None: no timer)."""
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(
                f"room {self.room}: illegal transfer transition {self.state.name} -> {new.name}"
            )
        self.state = new
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def result(self, error: str | None = None, **outcome: Unpack[Outcome]) -> TransferResult:
        assert self.terminal, self.state
        return TransferResult(
            room=self.room,
            state=self.state,
            metadata=outcome.get("metadata"),
            error=error,
            num_bytes=outcome.get("num_bytes", 0),
            seconds=time.monotonic() - self.started,
            prefix_mismatch=outcome.get("prefix_mismatch", False),
            direct=outcome.get("direct", False),
            shm=outcome.get("shm", False),
            corrupt=outcome.get("corrupt", False),
        )


@dataclass(kw_only=True)
class SendRoom(TransferRoom):
    """A room on the prefill node: what send() gave, and the decode peer once its page list came."""

    src_pages: list[int]
    num_tokens: int
    metadata: FirstToken
    block_hashes: list[int]  # of the prompt's whole pages: checks a page list's skipped prefix
    peer: bytes | None = None  # the decode node's zmq identity
    job: SendJob | None = None  # queued on the peer's pair thread, on `job.transport`
    abort_reason: str = ""

    @property
    def transport(self) -> SendTransport | None:
        return None if self.job is None else self.job.transport


@dataclass(kw_only=True)
class RecvRoom(TransferRoom):
    """A room on the decode node: the prefill node it comes from and the pages it lands in."""

    addr: str  # the prefill node's bootstrap address
    pages: list[int]  # for the room's pages from `skip_pages` on
    num_tokens: int
    skip_pages: int = 0  # whole pages whose KV this node holds already (its prefix cache)
    prefix_hash: int | None = None  # block hash of the last skipped page
