"""The prefill node's I/O thread state (KVSender, sender.py): every room, whatever the transport its
pages take (transport.py); its decode peers, their pairs and early page lists in sender_peers.py.

A room's data moves once both halves are known: send() from the prefill worker (pages, first token) and
the decode's PageList, in either order. Its transport is then the shared-memory segment where the
decode node mapped it (its page lists say so), else the pair group; the room is queued on the decode
peer's pair thread (sender_pair.py), which reports Started and Done. An abort (this node's, or the
decode's) cancels a room not started yet; a started one is reported when its transport ends it.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

import zmq
from typing_extensions import Unpack

from pdserve.kv_transfer import mailbox as mb
from pdserve.kv_transfer.layout import pages_for
from pdserve.kv_transfer.sender_pair import SenderPair
from pdserve.kv_transfer.sender_peers import SenderPeers
from pdserve.kv_transfer.state import Outcome, SendRoom, TransferState
from pdserve.kv_transfer.transport import SendJob
from pdserve.protocol import kv_control as kc

if TYPE_CHECKING:
    from pdserve.kv_transfer.sender import KVSender

log = logging.getLogger("pdserve.kv_transfer")

_FINISHED_MEMORY = 4096  # finished room ids remembered to answer late page lists


class SenderIO(SenderPeers):
    """State owned by the sender's I/O thread; every room transition happens here."""

    def __init__(self, owner: KVSender, router: zmq.Socket[bytes]) -> None:
        super().__init__(owner, router)
        self.finished: collections.OrderedDict[str, str] = collections.OrderedDict()  # room -> outcome

    # ---- room lifecycle -----------------------------------------------------------------

    def finish(
        self, room: SendRoom, state: TransferState, error: str | None = None, **outcome: Unpack[Outcome]
    ) -> None:
        self.remember(room.room, error or "success")
        super().finish(room, state, error, **outcome)

    def remember(self, name: str, outcome: str) -> None:
        self.finished[name] = outcome
        while len(self.finished) > _FINISHED_MEMORY:
            self.finished.popitem(last=False)

    def fail(self, room: SendRoom, error: str, corrupt: bool = False) -> None:
        """`corrupt`: the decode found the pages unlike their checksums (shared memory's Copied)."""
        if room.peer is not None:
            self.to_peer(room.peer, kc.Abort(room=room.room, reason=error))
        self.finish(room, TransferState.FAILED, error, corrupt=corrupt)

    def dispatch(self, room: SendRoom, peer: bytes, page_list: kc.PageList) -> None:
        """Both halves known: validate and queue the transfer on the pair's thread."""
        num_tokens, dst_pages = room.num_tokens, page_list.pages
        n_pages = pages_for(num_tokens, self.o._geometry.page_size)
        skip = page_list.skip_pages
        if skip:
            why = self.prefix_refusal(room, page_list, n_pages)
            if why is not None:
                # The room keeps waiting, for the full page list the decode node sends next.
                self.to_peer(peer, kc.PrefixMismatch(room=room.room, reason=why))
                return
        room.peer = peer
        pair = self.pairs.get(peer)
        error = None
        if pair is None:
            error = "the decode node's pair was closed before the transfer"
        elif page_list.num_tokens != num_tokens:
            error = f"token count mismatch: prefill has {num_tokens}, decode expects {page_list.num_tokens}"
        elif len(room.src_pages) < n_pages or len(dst_pages) < n_pages - skip:
            error = (
                f"{num_tokens} tokens need {n_pages} pages; prefill gave {len(room.src_pages)}, "
                f"decode gave {len(dst_pages)} after skipping {skip}"
            )
        if error is not None:
            self.fail(room, error)
            return
        assert pair is not None
        room.job = SendJob(
            room.room,
            room.src_pages[skip:n_pages],
            dst_pages[: n_pages - skip],
            num_tokens,
            room.metadata,
            transport=self.shm if page_list.shm and self.shm is not None else self.dist,
        )
        self.move(room, TransferState.BOOTSTRAPPING)  # the pair thread reports Started -> TRANSFERRING
        pair.submit(room.job)

    @staticmethod
    def prefix_refusal(room: SendRoom, page_list: kc.PageList, n_pages: int) -> str | None:
        """Why the skipped prefix of `page_list` cannot be trusted, or None: both sides must name
        the same tokens (chained block hash), and at least one page must still travel."""
        skip = page_list.skip_pages
        if skip >= n_pages:
            return f"{skip} pages skipped of {n_pages}: at least the last page travels"
        if len(room.block_hashes) < skip:
            return f"the prefill node has no hashes for {skip} pages of room {room.room}"
        if room.block_hashes[skip - 1] != page_list.prefix_hash:
            return f"the first {skip} pages of room {room.room} hold other tokens on the prefill node"
        return None

    # ---- events from this process --------------------------------------------------------------

    def on_local(self, item: mb.Item) -> None:
        match item:
            case mb.Send():
                self.on_send(item)
            case mb.Abort(room=name, reason=reason):
                self.abort(name, reason)
            case mb.Outbound(identity=identity, msg=msg):
                self.to_peer(identity, msg)
            case mb.Started(room=name):
                room = self.rooms.get(name)
                if room is not None and room.state == TransferState.BOOTSTRAPPING and room.transport:
                    self.move(room, TransferState.TRANSFERRING, room.transport.started_timeout_s)
            case mb.Done():
                self.on_done(item)
            case _:
                raise TypeError(f"unexpected mailbox item on the sender: {item!r}")

    def on_send(self, item: mb.Send) -> None:
        name = item.room
        if name in self.rooms or name in self.finished:
            outcome = "in progress" if name in self.rooms else self.finished[name]
            self.refuse(name, f"room {name} cannot be sent: already {outcome}")
            return
        room = SendRoom.enter(
            name,
            TransferState.WAITING_FOR_INPUT,
            self.cfg.waiting_timeout_s,
            started=item.t0,
            src_pages=item.src_pages,
            num_tokens=item.num_tokens,
            metadata=item.metadata,
            block_hashes=item.block_hashes,
        )
        self.enter(room)
        early = self.early.pop(name, None)
        if early is not None:
            self.dispatch(room, early.peer, early.msg)

    def release(self, room: SendRoom) -> SenderPair | None:
        """The pair thread is done with `room`'s job: one job fewer in flight on the peer's pair."""
        pair = self.pairs.get(room.peer or b"")
        if pair is not None:
            pair.inflight -= 1
        return pair

    def on_done(self, item: mb.Done) -> None:
        room = self.rooms.get(item.room)
        if room is None:
            return
        pair = self.release(room)
        if pair is not None:
            pair.last_used = time.monotonic()
        error = (room.abort_reason or "aborted") if room.aborted else item.error
        if error is None:
            self.finish(room, TransferState.SUCCESS, num_bytes=item.num_bytes)
        else:
            self.fail(room, error, corrupt=item.corrupt and not room.aborted)

    def abort(self, name: str, reason: str) -> None:
        """A room not started yet is cancelled (its Done follows); a started one is reported when its
        transport ends it: shared memory waits for the decode's Copied (or its timer), since giving it
        up would fence the segment, failing every copy running at that moment."""
        self.early.pop(name, None)
        room = self.rooms.get(name)
        if room is None:
            self.remember(name, reason)  # a send() that comes later fails at once
            return
        if room.state == TransferState.WAITING_FOR_INPUT:
            self.fail(room, reason)
            return
        room.aborted = True
        room.abort_reason = reason
        assert room.job is not None
        room.job.cancelled.set()

    # ---- events from decode nodes ------------------------------------------------------------

    def on_peer(self, identity: bytes, msg: kc.Message) -> None:
        pair = self.pairs.get(identity)
        match msg:
            case kc.Hello():
                self.on_hello(identity, msg)
            case kc.PageList():
                self.on_page_list(identity, msg)
            case kc.Copied(room=name):
                room = self.rooms.get(name)
                done = None
                if room is not None and room.peer == identity and self.shm is not None:
                    done = self.shm.copied(room, msg)
                if done is not None:
                    self.on_done(done)
            case kc.StoreSet() if pair is not None:
                pair.deliver(msg)
            case kc.Abort(room=name, reason=reason):
                # The decode answers an announcement that crossed this Abort with Copied: wait for it.
                self.abort(name, f"aborted by decode: {reason}")
            case kc.PairDead(gen=gen) if pair is not None:
                pair.discard_gen = gen
            case kc.Bye() if pair is not None:
                self.close_pair(pair)
            case kc.StoreSet() | kc.PairDead() | kc.Bye():
                pass  # a pair closed already
            case _:
                log.warning("kv_transfer: unexpected %s from decode %r", msg.kind, identity)

    def on_page_list(self, identity: bytes, msg: kc.PageList) -> None:
        name = msg.room
        if identity not in self.pairs:
            # A decode node that paired with an earlier process at this address (this node
            # restarted): `unknown_pair` tells it to handshake again and resend the page list.
            self.to_peer(
                identity, kc.Abort(room=name, reason="page list before a handshake", unknown_pair=True)
            )
            return
        self.pairs[identity].last_used = time.monotonic()
        room = self.rooms.get(name)
        if room is not None and room.state == TransferState.WAITING_FOR_INPUT:
            self.dispatch(room, identity, msg)
        elif room is not None:
            self.to_peer(identity, kc.Abort(room=name, reason=f"room {name} already has a page list"))
        elif name in self.finished:
            reason = f"room {name} already finished on the prefill node: {self.finished[name]}"
            self.to_peer(identity, kc.Abort(room=name, reason=reason))
        else:
            self.keep_early(identity, msg)

    def in_flight(self) -> bool:
        return bool(self.rooms or self.early)

    def on_timers(self, now: float) -> None:
        for room in [r for r in self.rooms.values() if r.expired(now)]:
            if room.state == TransferState.TRANSFERRING and room.transport is not None:
                error = room.transport.give_up(room)  # the pages are freed next
                self.release(room)
                self.fail(room, error)
                continue
            self.fail(
                room, f"timed out after {self.cfg.waiting_timeout_s}s waiting for the decode's page list"
            )
        self.expire_peers(now)
