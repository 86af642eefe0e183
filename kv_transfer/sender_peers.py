"""The prefill node's decode peers, on its I/O thread (SenderIO, sender_io.py, builds its rooms on it):
the handshake that makes each peer's pair (sender_pair.py), the cap on pairs (`max_pairs`: an idle one
is evicted for a newcomer), the page lists that come before their room's send() (kept within each
peer's caps until send() or orphan_request_ttl_s), and the transports a peer's pages may take.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from pdserve.kv_transfer.dist_transport import DistSend
from pdserve.kv_transfer.handshake import compare_identities
from pdserve.kv_transfer.layout import mapping_error
from pdserve.kv_transfer.rooms import RoomBook
from pdserve.kv_transfer.sender_pair import SenderPair
from pdserve.kv_transfer.shm_transport import ShmSend
from pdserve.kv_transfer.state import SendRoom
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError, VersionMismatch

if TYPE_CHECKING:
    from pdserve.kv_transfer.sender import KVSender

log = logging.getLogger("pdserve.kv_transfer")


@dataclass(frozen=True)
class EarlyPageList:
    """A decode's page list that came before send(): kept until send() or orphan_request_ttl_s."""

    peer: bytes
    msg: kc.PageList
    arrived: float


class SenderPeers(RoomBook[SendRoom, bytes]):
    """The decode peers of the sender's I/O state: their pairs, handshakes and early page lists."""

    def __init__(self, owner: KVSender, router: zmq.Socket[bytes]) -> None:
        super().__init__(owner)
        self.o = owner
        self.router = router
        self.poller.register(router, zmq.POLLIN)
        self.early: dict[str, EarlyPageList] = {}
        self.pairs: dict[bytes, SenderPair] = {}
        self._gens = itertools.count()
        self._gen_lock = threading.Lock()
        hooks = owner._hooks  # one for both transports (a corruption count is shared)
        self.dist = DistSend(owner._kv, owner._geometry, self.cfg, hooks, owner._prepare)
        self.shm = (
            ShmSend(owner._kv, owner._segments, owner._geometry, self.cfg, hooks) if owner._segments else None
        )

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
        self.join_closing()

    def close_pair(self, pair: SenderPair, bye: str | None = None) -> None:
        """Close `pair`; with `bye`, tell the peer why and refuse its early page lists."""
        if bye is not None:
            self.to_peer(pair.identity, kc.Bye(reason=bye))
            for name in [n for n, e in self.early.items() if e.peer == pair.identity]:
                del self.early[name]
                self.to_peer(pair.identity, kc.Abort(room=name, reason=bye))
        self.pairs.pop(pair.identity, None)
        self.retire(pair)

    def to_peer(self, identity: bytes, msg: kc.Message) -> None:
        try:
            self.router.send_multipart([identity, kc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or its queue full; its own timers handle the rest

    def on_refused(self, identity: bytes, error: ProtocolError) -> None:
        log.warning("kv_transfer: refused a frame from decode %r: %s", identity, error)
        if isinstance(error, VersionMismatch) and error.kind == "hello":
            # A decode node of another release: refuse the pair, saying why.
            self.o._errors.append(f"refused decode {identity.decode(errors='replace')}: {error}")
            self.to_peer(identity, kc.HelloAck(ok=False, mismatch=True, error=str(error)))

    def on_hello(self, identity: bytes, msg: kc.Hello) -> None:
        error = compare_identities(self.o._identity, msg.identity, "decode")
        if error is None:
            error = mapping_error(self.o._geometry.kv_heads, self.o._tp_size, msg.tp_size)
            if error is not None:
                error += ", pair refused"
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
                host=self.o._host,
                config=self.cfg,
                mailbox=self.o._mailbox,
                gens=self.next_gen,
            )
            self.pairs[identity] = pair
        gen = pair.new_gen()
        pair.build(gen)
        offer = None if self.shm is None else self.shm.offer()
        self.to_peer(identity, kc.HelloAck(ok=True, gen=gen, shm=offer, tp_size=self.o._tp_size))

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
        self.early[msg.room] = EarlyPageList(identity, msg, time.monotonic())

    def expire_peers(self, now: float) -> None:
        """Drop early page lists past their time, and pairs whose group never came up."""
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
