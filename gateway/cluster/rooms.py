"""A generation in flight at the control plane (`Room`), the events its inbox carries, and the delivery
of each worker output to its room.

An output for a room counts only from the worker the room's leg was routed to (`Room.prefill`,
`Room.decode`); anyone else's is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.protocol.gateway import PrefillDone, RequestFailed, Role, TokenBatch, TokenOutput
from pdserve.protocol.vocabulary import FailCode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokensArrived:
    output: TokenOutput
    t_recv: float  # gateway wall clock at receipt
    # "prefill": the first token, carried by PrefillDone before the KV lands (the decode reports it again).
    source: Role = "decode"


@dataclass(frozen=True)
class LegFailed:
    role: Role
    code: FailCode  # RequestFailed.code, or FailCode.WORKER_LOST
    message: str
    reported: bool  # True: the failing leg told us itself (no need to abort it)


@dataclass(frozen=True)
class RoomAborted:
    """The gateway itself ended the room: it is shutting down, or /abort_request named the request."""

    code: FailCode  # FailCode.SHUTDOWN or FailCode.CLIENT_ABORT
    message: str


RoomEvent = TokensArrived | LegFailed | RoomAborted


@dataclass
class Room:
    """One generation in flight: its two legs and the inbox the request handler reads. `prefill` is
    None for a local prefill (conditional disaggregation: the decode worker computes the prompt, and
    its first output carries the prefill events that PrefillDone carries otherwise); `decode` is None
    for a request with nothing to decode (max_new_tokens 0 or 1: PrefillDone answers it). Never both."""

    room: str
    prefill: WorkerInfo | None
    decode: WorkerInfo | None
    tokens: int  # the work reserved on both legs (for routing)
    inbox: asyncio.Queue[RoomEvent] = field(default_factory=asyncio.Queue)
    prefill_done: PrefillDone | None = None
    prefill_done_at: float | None = None
    prefill_event: asyncio.Event = field(default_factory=asyncio.Event)
    rid: str = ""  # the client's request id (for /abort_request)

    def leg(self, role: Role) -> WorkerInfo:
        """The worker that speaks for `role` here: a missing leg's work is the other's (a local
        prefill's events come from the decode worker, the answer without a decode leg from the prefill)."""
        w = (self.prefill or self.decode) if role == "prefill" else (self.decode or self.prefill)
        assert w is not None, "a room has at least one leg"
        return w


def deliver_tokens(rooms: dict[str, Room], worker: WorkerInfo, batch: TokenBatch, t_recv: float) -> None:
    for out in batch.outputs:
        room = rooms.get(out.room)
        if room is None:
            log.debug("tokens for unknown room %s (finished or aborted)", out.room)
            continue
        if room.decode is not worker:
            log.warning("tokens for room %s from %s, not its decode leg: dropped", out.room, worker.worker_id)
            continue
        room.inbox.put_nowait(TokensArrived(out, t_recv))


def deliver_prefill_done(
    rooms: dict[str, Room], worker: WorkerInfo, msg: PrefillDone, t_recv: float, registry: WorkerRegistry
) -> None:
    """Record the prefill leg's end (its reserved work is released) and pass on its first token."""
    room = rooms.get(msg.room)
    if room is None:
        log.debug("prefill_done for unknown room %s", msg.room)
        return
    if room.prefill is not worker:
        log.warning(
            "prefill_done for room %s from %s, not its prefill leg: dropped", msg.room, worker.worker_id
        )
        return
    if room.prefill_done is None:
        room.prefill_done, room.prefill_done_at = msg, t_recv
        registry.release(worker, room.tokens)
        room.prefill_event.set()
        if msg.first is not None:
            room.inbox.put_nowait(TokensArrived(msg.first, t_recv, source="prefill"))


def deliver_failure(rooms: dict[str, Room], worker: WorkerInfo, msg: RequestFailed) -> None:
    room = rooms.get(msg.room)
    if room is None:
        log.debug("failure for unknown room %s: %s", msg.room, msg.message)
        return
    if (room.prefill if msg.role == "prefill" else room.decode) is not worker:
        log.warning(
            "failure for room %s from %s, not its %s leg: dropped", msg.room, worker.worker_id, msg.role
        )
        return
    room.inbox.put_nowait(LegFailed(msg.role, msg.code, msg.message, reported=True))


def fail_rooms_of(rooms: dict[str, Room], w: WorkerInfo, message: str) -> None:
    """`w` is lost or restarted: every room that still needs it fails with `FailCode.WORKER_LOST`."""
    for room in list(rooms.values()):
        # A prefill worker is no longer needed once its PrefillDone arrived.
        if room.decode is w or (room.prefill is w and room.prefill_done is None):
            room.inbox.put_nowait(LegFailed(w.role, FailCode.WORKER_LOST, message, reported=False))
