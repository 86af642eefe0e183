"""KVSender: the prefill node's end of the KV hand-off.

Threads: the caller's (send/abort/poll only post to a mailbox or read a deque, never block), one I/O
thread that owns all room state and the pyzmq ROUTER bootstrap socket, and one control thread per pair
(SenderPair) that builds the pair's process group and runs its transfers in order.

A room's data moves once both halves are known: send() from the prefill worker (pages, metadata) and
the decode's REQUEST (its page list), in either order. Pages given to send() stay in use until poll()
reports the room (SUCCESS or FAILED); free them then, not before.

Exposure: with cluster keys (TransferConfig.keys) the bootstrap ROUTER runs CurveZMQ behind a ZAP
handler, so only holders of the cluster secret reach it; nothing is allocated for anyone else. Every
limit below holds with or without keys: a frame is at most `max_frame_bytes`; a peer's early page
lists (rooms not sent yet) are capped in number and pages, the oldest refused; a pair whose group was
never built (a handshake the peer never completed) is closed after twice `bootstrap_timeout_s`, and idle
pairs are evicted beyond `max_pairs`, unbuilt ones first. The pair groups meet through keys carried
on this same channel (pair_store.py): no store port is opened.

Same host (shm.py): given the shared-memory segment its pool lives in, the sender offers it in every
HelloAck; a decode node that mapped it says so in its page lists, and those rooms are announced with
their page ids for the decode to copy itself. Such a room stays TRANSFERRING until the decode's Copied,
for at most `transfer_timeout_s`; giving up on it (timeout, shutdown) fences the segment first. An abort
(this node's, for the gateway's AbortRequest, or the decode's) does not give up on an announced room: the
decode answers every announcement with Copied, and the room fails then, so that a fence bump does not fail
the other rooms' copies running at that moment (the timeout still bounds the wait).
"""

from __future__ import annotations

import base64
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.cluster_auth import secure_server, start_authenticator
from pdserve.kv_transfer import mailbox as mb
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.endpoint import Endpoint
from pdserve.kv_transfer.handshake import compare_identities
from pdserve.kv_transfer.io_loop import EndpointIO
from pdserve.kv_transfer.layout import pages_for
from pdserve.kv_transfer.sender_pair import SenderPair, SendJob
from pdserve.kv_transfer.shm import SharedSegment
from pdserve.kv_transfer.state import SendRoom, TransferResult, TransferState
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError, VersionMismatch
from pdserve.protocol.kv_trailer import FirstToken

log = logging.getLogger("pdserve.kv_transfer")

_FINISHED_MEMORY = 4096  # finished room ids remembered to answer late page lists


class KVSender(Endpoint):
    """Sends finished prefills' KV pages to the decode nodes that ask for them."""

    def __init__(
        self,
        kv: Any,
        fingerprint: dict[str, str | int],
        host: str,
        bootstrap_port: int,
        config: TransferConfig,
        segment: SharedSegment | None = None,
    ) -> None:
        """`segment`: the shared-memory segment `kv` lives in (shm.shared_pool), offered to decode
        nodes on this host unless config.transport is "dist"."""
        super().__init__(kv, fingerprint, config)
        if segment is not None:
            inside = segment.pool((self._geometry.num_pages, *self._geometry.page_shape), self._kv.dtype)
            if inside.data_ptr() != self._kv.data_ptr():
                raise ValueError("the KV pool does not live in the shared-memory segment given")
        self._own_segment = segment  # closed (removed) with the sender, offered or not
        self._segment = segment if config.transport != "dist" else None
        self._host, self._port = host, bootstrap_port
        self._errors: collections.deque[str] = collections.deque(maxlen=64)
        self.addr = ""

    # ---- public interface (any thread, non-blocking) ------------------------------------

    def start(self) -> None:
        """Bind the bootstrap ROUTER; start the I/O thread."""
        self._ctx = zmq.Context()
        if self._config.keys is not None:
            self._auth = start_authenticator(self._ctx, self._config.keys)
        router = self._ctx.socket(zmq.ROUTER)
        secure_server(router, self._config.keys, self._config.max_frame_bytes)
        router.setsockopt(zmq.LINGER, 0)
        # A decode node that reconnects (after a refusal, eviction or timeout) reuses its identity: let the
        # new connection take it over instead of having its messages dropped as a duplicate.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self._port == 0:
            port = router.bind_to_random_port(f"tcp://{self._host}")
        else:
            router.bind(f"tcp://{self._host}:{self._port}")
            port = self._port
        self.addr = f"{self._host}:{port}"
        self._thread = threading.Thread(
            target=self._io_loop, args=(router,), name="kv-sender-io", daemon=True
        )
        self._thread.start()

    def send(
        self,
        room: str,
        src_pages: list[int],
        num_tokens: int,
        metadata: FirstToken,
        block_hashes: list[int] | None = None,
    ) -> None:
        """The prefill of `room` is done: send its pages once the decode's page list is here.

        `block_hashes`: the chained hashes of the prompt's whole pages (`protocol.block_hash`); with
        them, a decode node that holds a prefix of the prompt receives only the pages after it. Without
        them, a page list that skips pages is answered with PrefixMismatch (a full transfer follows)."""
        self._mailbox.post(
            mb.Send(
                room,
                list(src_pages),
                int(num_tokens),
                metadata,
                time.monotonic(),
                list(block_hashes or []),
            )
        )

    def abort(self, room: str) -> None:
        """Give up on `room`; its FAILED result still comes out of poll() (free the pages then)."""
        self._mailbox.post(mb.Abort(room, "aborted by prefill"))

    def handshake_errors(self) -> list[str]:
        """Recent refused handshakes (fingerprint mismatches, too many pairs), oldest first."""
        return list(self._errors)

    # ---- I/O thread ---------------------------------------------------------------------------

    def _io_loop(self, router: zmq.Socket[bytes]) -> None:
        try:
            self._run_io(_SenderIO(self, router))
        finally:
            router.close(linger=0)

    def close(self) -> None:
        super().close()
        if self._own_segment is not None:
            self._own_segment.close()  # fences any copy still running, removes the file
            self._own_segment = None


@dataclass(frozen=True)
class _EarlyPageList:
    """A decode's page list that came before send(): kept until send() or orphan_request_ttl_s."""

    peer: bytes
    msg: kc.PageList
    arrived: float


class _SenderIO(EndpointIO):
    """State owned by the sender's I/O thread; every room transition happens here."""

    def __init__(self, owner: KVSender, router: zmq.Socket[bytes]) -> None:
        super().__init__(owner._mailbox)
        self.o = owner
        self.cfg = owner._config
        self.router = router
        self.poller.register(router, zmq.POLLIN)
        self.rooms: dict[str, SendRoom] = {}
        self.early: dict[str, _EarlyPageList] = {}
        self.pairs: dict[bytes, SenderPair] = {}
        self.finished: collections.OrderedDict[str, str] = collections.OrderedDict()  # room -> outcome
        self._gens = itertools.count()
        self._gen_lock = threading.Lock()
        # Closed pairs whose threads may still be finishing; joined at shutdown so that no pair thread
        # is torn down inside a process group's destructor at interpreter exit.
        self.closing: list[SenderPair] = []

    def next_gen(self) -> int:
        """A pair group generation never used before on this sender's store (any thread)."""
        with self._gen_lock:
            return next(self._gens)

    def owns(self, sock: zmq.Socket[bytes]) -> bool:
        return sock is self.router

    def peer_of(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> bytes | None:
        if len(frames) != 2:  # [identity, payload] on a ROUTER: anything else is not a decode node's
            log.warning("kv_transfer: dropped a %d-part message on the bootstrap port", len(frames))
            return None
        return frames[0]

    def shutdown(self) -> None:
        for pair in list(self.pairs.values()):
            self.to_peer(pair.identity, kc.Bye(reason="prefill node shutting down"))
            self.close_pair(pair)
        for pair in self.closing:
            pair.join(timeout_s=2.0)

    def close_pair(self, pair: SenderPair, bye: str | None = None) -> None:
        """Close `pair`; with `bye`, tell the peer why and refuse its early page lists."""
        if bye is not None:
            self.to_peer(pair.identity, kc.Bye(reason=bye))
            for name in [n for n, e in self.early.items() if e.peer == pair.identity]:
                del self.early[name]
                self.to_peer(pair.identity, kc.Abort(room=name, reason=bye))
        pair.close()
        self.pairs.pop(pair.identity, None)
        self.closing = [p for p in self.closing if p.alive] + [pair]

    def to_peer(self, identity: bytes, msg: kc.Message) -> None:
        try:
            self.router.send_multipart([identity, kc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or its queue full; its own timers handle the rest

    # ---- room lifecycle -----------------------------------------------------------------

    def finish(
        self, room: SendRoom, state: TransferState, error: str | None = None, num_bytes: int = 0
    ) -> None:
        room.transition(state)
        self.rooms.pop(room.room, None)
        self.o._states.pop(room.room, None)
        self.remember(room.room, error or "success")
        self.o._publish(room.result(metadata=None, error=error, num_bytes=num_bytes))

    def remember(self, name: str, outcome: str) -> None:
        self.finished[name] = outcome
        while len(self.finished) > _FINISHED_MEMORY:
            self.finished.popitem(last=False)

    def fail(self, room: SendRoom, error: str) -> None:
        if room.peer is not None:
            self.to_peer(room.peer, kc.Abort(room=room.room, reason=error))
        self.finish(room, TransferState.FAILED, error)

    def move(self, room: SendRoom, state: TransferState, timeout_s: float | None = None) -> None:
        room.transition(state, timeout_s)
        self.o._states[room.room] = state

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
            shm=page_list.shm and self.o._segment is not None,
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
            case mb.Started(room=name, shm=shm):
                room = self.rooms.get(name)
                if room is not None and room.state == TransferState.BOOTSTRAPPING:
                    # Shared memory: the decode's Copied ends the room, within transfer_timeout_s.
                    room.shm = shm
                    self.move(room, TransferState.TRANSFERRING, self.cfg.transfer_timeout_s if shm else None)
            case mb.Done():
                self.on_done(item)
            case _:
                raise TypeError(f"unexpected mailbox item on the sender: {item!r}")

    def on_send(self, item: mb.Send) -> None:
        name = item.room
        if name in self.rooms or name in self.finished:
            outcome = "in progress" if name in self.rooms else self.finished[name]
            error = f"room {name} cannot be sent: already {outcome}"
            self.o._publish(TransferResult(name, TransferState.FAILED, None, error, 0, 0.0))
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
        self.rooms[name] = room
        self.o._states[name] = room.state
        early = self.early.pop(name, None)
        if early is not None:
            self.dispatch(room, early.peer, early.msg)

    def give_up_shm(self, room: SendRoom, error: str) -> None:
        """End a room the decode may be copying from shared memory: fence first, so that a copy still
        under way is refused, then free (the pair's job is over)."""
        assert self.o._segment is not None
        self.o._segment.bump_fence()
        pair = self.pairs.get(room.peer or b"")
        if pair is not None:
            pair.inflight -= 1
        self.fail(room, error)

    def on_copied(self, identity: bytes, msg: kc.Copied) -> None:
        room = self.rooms.get(msg.room)
        if room is None or not room.shm or room.peer != identity:
            return  # given up already (fenced), or not this peer's
        assert room.job is not None
        nbytes = len(room.job.src_pages) * self.o._geometry.page_bytes
        self.on_done(mb.Done(room.room, msg.error or None, nbytes if not msg.error else 0))

    def on_done(self, item: mb.Done) -> None:
        room = self.rooms.get(item.room)
        if room is None:
            return
        pair = self.pairs.get(room.peer or b"")
        if pair is not None:
            pair.inflight -= 1
            pair.last_used = time.monotonic()
        error = (room.abort_reason or "aborted") if room.aborted else item.error
        if error is None:
            self.finish(room, TransferState.SUCCESS, num_bytes=item.num_bytes)
        else:
            self.fail(room, error)

    def abort(self, name: str, reason: str) -> None:
        """An announced shared-memory room fails when the decode's Copied comes (or its timer ends), not
        now: giving it up would fence the segment, failing every copy running at that moment."""
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
        if room.shm:  # the decode's Copied (or the timer) ends it, as aborted
            return
        # Queued or running on the pair thread: its Done reports the room.
        assert room.job is not None
        room.job.cancelled.set()

    # ---- events from decode nodes ------------------------------------------------------------

    def on_refused(self, identity: bytes, error: ProtocolError) -> None:
        log.warning("kv_transfer: refused a frame from decode %r: %s", identity, error)
        if isinstance(error, VersionMismatch) and error.kind == "hello":
            # A decode node of another release: refuse the pair, saying why.
            self.o._errors.append(f"refused decode {identity.decode(errors='replace')}: {error}")
            self.to_peer(identity, kc.HelloAck(ok=False, mismatch=True, error=str(error)))

    def on_peer(self, identity: bytes, msg: kc.Message) -> None:
        match msg:
            case kc.Hello():
                self.on_hello(identity, msg)
            case kc.PageList():
                self.on_page_list(identity, msg)
            case kc.Copied():
                self.on_copied(identity, msg)
            case kc.StoreSet(gen=gen, key=key, value=value):
                pair = self.pairs.get(identity)
                if pair is not None:
                    pair.stores.deliver(gen, key, base64.b64decode(value, validate=True))
            case kc.Abort(room=name, reason=reason):
                # The decode answers an announcement that crossed this Abort with Copied: wait for it.
                self.abort(name, f"aborted by decode: {reason}")
            case kc.PairDead(gen=gen):
                pair = self.pairs.get(identity)
                if pair is not None:
                    pair.discard_gen = gen
            case kc.Bye():
                pair = self.pairs.get(identity)
                if pair is not None:
                    self.close_pair(pair)
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

    def keep_early(self, identity: bytes, msg: kc.PageList) -> None:
        """Keep a page list for a room not sent yet, within the peer's caps (the oldest goes first)."""
        if len(msg.pages) > self.cfg.max_early_pages:
            self.to_peer(identity, kc.Abort(room=msg.room, reason="page list too long"))
            return
        old = self.early.pop(msg.room, None)
        if old is not None and old.peer != identity:
            self.early[msg.room] = old  # another peer's room: not ours to replace
            self.to_peer(identity, kc.Abort(room=msg.room, reason=f"room {msg.room} has a page list"))
            return
        mine = [e for e in self.early.values() if e.peer == identity]  # oldest first (insertion order)
        pages = sum(len(e.msg.pages) for e in mine) + len(msg.pages)
        while mine and (len(mine) >= self.cfg.max_early_lists or pages > self.cfg.max_early_pages):
            drop = mine.pop(0)
            pages -= len(drop.msg.pages)
            del self.early[drop.msg.room]
            self.to_peer(identity, kc.Abort(room=drop.msg.room, reason="too many early page lists"))
        self.early[msg.room] = _EarlyPageList(identity, msg, time.monotonic())

    def on_hello(self, identity: bytes, msg: kc.Hello) -> None:
        error = compare_identities(self.o._identity, msg.identity, "decode")
        mismatch = error is not None
        if error is None and identity not in self.pairs and not self.make_room_for_pair():
            error = f"prefill node at its limit of {self.cfg.max_pairs} pairs, all busy"
        if error is not None:
            self.o._errors.append(f"refused decode {identity.decode(errors='replace')}: {error}")
            self.to_peer(identity, kc.HelloAck(ok=False, mismatch=mismatch, error=error))
            return
        pair = self.pairs.get(identity)
        if pair is None:
            pair = SenderPair(
                identity=identity,
                kv=self.o._kv,
                geometry=self.o._geometry,
                host=self.o._host,
                config=self.cfg,
                mailbox=self.o._mailbox,
                gens=self.next_gen,
                segment=self.o._segment,
            )
            self.pairs[identity] = pair
        gen = pair.new_gen()
        pair.build(gen)
        seg, offer = self.o._segment, None
        if seg is not None:
            offer = kc.ShmOffer(path=seg.path, token=seg.token.hex(), num_pages=self.o._geometry.num_pages)
        self.to_peer(identity, kc.HelloAck(ok=True, gen=gen, shm=offer))

    def make_room_for_pair(self) -> bool:
        """Close an idle pair if at the limit: one whose group was never built first, then the least
        recently used. False if every pair has a transfer or waits for one. Early page lists pin
        only a pair whose group was built (a stranger's handshake with bogus page lists, never
        followed by the group, would otherwise lock out every real decode node)."""
        if len(self.pairs) < self.cfg.max_pairs:
            return True
        built = {p.identity for p in self.pairs.values() if p.built_gen >= 0}
        busy = {r.peer for r in self.rooms.values()} | {e.peer for e in self.early.values()} & built
        idle = [p for p in self.pairs.values() if p.inflight == 0 and p.identity not in busy]
        if not idle:
            return False
        victim = min(idle, key=lambda p: (p.built_gen >= 0, p.last_used))
        self.close_pair(victim, "pair evicted (max_pairs)")
        return True

    def in_flight(self) -> bool:
        return bool(self.rooms or self.early)

    def on_timers(self, now: float) -> None:
        for room in [r for r in self.rooms.values() if r.expired(now)]:
            if room.shm:
                why = (
                    f"timed out after {self.cfg.transfer_timeout_s}s waiting for the decode to copy the pages"
                )
                self.give_up_shm(room, why)
                continue
            self.fail(
                room, f"timed out after {self.cfg.waiting_timeout_s}s waiting for the decode's page list"
            )
        ttl = self.cfg.orphan_request_ttl_s
        for name in [n for n, e in self.early.items() if now - e.arrived > ttl]:
            del self.early[name]
        # A handshake whose pair group never came up (the peer never joined it) and that waits for
        # nothing holds a slot for nothing. (One with page lists waiting is left alone: a real decode
        # node whose first build failed builds again at its first transfer.)
        stale = now - 2 * self.cfg.bootstrap_timeout_s
        waiting = {e.peer for e in self.early.values()} | {r.peer for r in self.rooms.values()}
        for pair in [
            p
            for p in self.pairs.values()
            if p.built_gen < 0 and p.inflight == 0 and p.created < stale and p.identity not in waiting
        ]:
            self.close_pair(pair, "the pair group was never built")
