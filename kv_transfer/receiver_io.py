"""The decode node's I/O thread state (KVReceiver, receiver.py): every room and prefill peer, whatever
the transport its pages take (transport.py).

A room enters at request(), waits for its peer's handshake (BOOTSTRAPPING), sends its page list
(WAITING_FOR_INPUT) and is handed to a transport at the prefill node's announcement (TRANSFERRING):
the peer's shared-memory segment where this node mapped it at the handshake, else the pair group. The
peer's pair thread (receiver_pair.py) lands the pages and reports Done.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import zmq

from pdserve.cluster_auth import secure_client
from pdserve.kv_transfer import mailbox as mb
from pdserve.kv_transfer.dist_transport import DistReceive
from pdserve.kv_transfer.handshake import FingerprintMismatch
from pdserve.kv_transfer.io_loop import split_addr
from pdserve.kv_transfer.layout import mapping_error
from pdserve.kv_transfer.receiver_pair import ReceiverPair
from pdserve.kv_transfer.rooms import RoomBook
from pdserve.kv_transfer.shm_transport import RankPools, ShmReceive, map_segment
from pdserve.kv_transfer.state import RecvRoom, TransferState
from pdserve.kv_transfer.transport import ReceiveTransport
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError, VersionMismatch

if TYPE_CHECKING:
    from pdserve.kv_transfer.receiver import KVReceiver

log = logging.getLogger("pdserve.kv_transfer")

J = TypeVar("J")


@dataclass
class _Peer:
    addr: str
    sock: zmq.Socket[bytes]
    ready: bool = False
    hello_deadline: float = 0.0
    pair: ReceiverPair | None = None
    pending: list[str] = field(default_factory=list)  # rooms waiting for the handshake
    futures: list[concurrent.futures.Future[None]] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    shm: ShmReceive | None = None  # made with the pair, at the HelloAck


class ReceiverIO(RoomBook[RecvRoom, _Peer]):
    """State owned by the receiver's I/O thread; every room transition happens here."""

    def __init__(self, owner: KVReceiver) -> None:
        super().__init__(owner)
        self.o = owner
        self.peers: dict[str, _Peer] = {}
        self.by_sock: dict[zmq.Socket[bytes], _Peer] = {}
        self.dist = DistReceive(owner._kv, owner._geometry)
        self.shm_refusals: set[str] = set()  # fall-back reasons logged already (auto: once each)

    def owns(self, sock: zmq.Socket[bytes]) -> bool:
        return sock in self.by_sock

    def peer_of(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> _Peer | None:
        if len(frames) != 1:  # a ROUTER sends us one frame per message
            log.warning("kv_transfer: dropped a %d-part message from a prefill node", len(frames))
            return None
        return self.by_sock.get(sock)

    def shutdown(self) -> None:
        for peer in list(self.peers.values()):
            self.send(peer, kc.Bye(reason="decode node shutting down"))
            self.drop_peer(peer, "receiver closed")
        self.join_closing()

    def send(self, peer: _Peer, msg: kc.Message) -> None:
        try:
            peer.sock.send(kc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer's own timers handle a lost message

    # ---- peers ---------------------------------------------------------------------------------

    def peer_for(self, addr: str) -> _Peer | str:
        """The peer for addr, saying Hello if new; an error string if no pair slot is free."""
        peer = self.peers.get(addr)
        if peer is not None:
            return peer
        if len(self.peers) >= self.cfg.max_pairs:
            busy = {r.addr for r in self.rooms.values()}
            idle = [p for p in self.peers.values() if p.addr not in busy and not p.futures]
            if not idle:
                return f"decode node at its limit of {self.cfg.max_pairs} prefill pairs, all busy"
            victim = min(idle, key=lambda p: p.last_used)
            self.send(victim, kc.Bye(reason="pair evicted (max_pairs)"))
            self.drop_peer(victim, "evicted")
        assert self.o._ctx is not None  # made by start(), before this thread
        sock = self.o._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.o.receiver_id.encode())
        secure_client(sock, self.cfg.keys, self.cfg.max_frame_bytes)
        host, port = split_addr(addr)
        sock.connect(f"tcp://{addr}" if ":" not in host else f"tcp://[{host}]:{port}")
        peer = _Peer(addr, sock, hello_deadline=time.monotonic() + self.cfg.bootstrap_timeout_s)
        self.peers[addr] = peer
        self.by_sock[sock] = peer
        self.poller.register(sock, zmq.POLLIN)
        self.send(
            peer, kc.Hello(receiver_id=self.o.receiver_id, identity=self.o._identity, tp_size=self.o._tp_size)
        )
        return peer

    def drop_peer(self, peer: _Peer, reason: str, exc_type: type[Exception] = ConnectionError) -> None:
        """Forget a peer: fail its rooms that are not mid-transfer, close its socket and pair thread."""
        for room in [r for r in self.rooms.values() if r.addr == peer.addr]:
            if room.state != TransferState.TRANSFERRING:
                self.finish(room, TransferState.FAILED, error=reason)
        for future in peer.futures:
            if not future.done():
                future.set_exception(exc_type(reason))
        self.close_peer(peer)

    def close_peer(self, peer: _Peer) -> None:
        self.peers.pop(peer.addr, None)
        self.by_sock.pop(peer.sock, None)
        self.poller.unregister(peer.sock)
        peer.sock.close(linger=0)
        if peer.pair is not None:
            self.retire(peer.pair)

    def rehandshake(self, peer: _Peer) -> None:
        """The prefill node at peer.addr restarted and does not know our pair: close the old pair and
        handshake anew; its rooms not mid-transfer go back to bootstrapping and resend their page lists."""
        if self.peers.get(peer.addr) is not peer or not peer.ready:
            return
        rooms = [
            r for r in self.rooms.values() if r.addr == peer.addr and r.state != TransferState.TRANSFERRING
        ]
        for r in rooms:
            if r.state == TransferState.WAITING_FOR_INPUT:
                self.move(r, TransferState.BOOTSTRAPPING, self.cfg.bootstrap_timeout_s)
        self.close_peer(peer)
        fresh = self.peer_for(peer.addr)
        if isinstance(fresh, str):
            for r in rooms:
                self.fail(r, fresh)
            return
        fresh.pending.extend(r.room for r in rooms)
        fresh.futures.extend(peer.futures)

    # ---- rooms ----------------------------------------------------------------------------------

    def fail(self, room: RecvRoom, error: str) -> None:
        """Fail a room that is not mid-transfer and tell the prefill node (if it had the page list)."""
        peer = self.peers.get(room.addr)
        if peer is not None and room.state == TransferState.WAITING_FOR_INPUT:
            self.send(peer, kc.Abort(room=room.room, reason=error))
        self.finish(room, TransferState.FAILED, error=error)

    def send_page_list(self, peer: _Peer, room: RecvRoom) -> None:
        self.send(
            peer,
            kc.PageList(
                room=room.room,
                pages=room.pages,
                num_tokens=room.num_tokens,
                skip_pages=room.skip_pages,
                prefix_hash=room.prefix_hash,
                shm=peer.shm is not None and peer.shm.src is not None,
            ),
        )
        self.move(room, TransferState.WAITING_FOR_INPUT, self.cfg.waiting_timeout_s)

    # ---- events from this process ---------------------------------------------------------------

    def on_local(self, item: mb.Item) -> None:
        match item:
            case mb.Request():
                self.on_request(item)
            case mb.Connect(addr=addr, future=future):
                peer = self.peer_for(addr)
                if isinstance(peer, str):
                    future.set_exception(ConnectionError(peer))
                elif peer.ready:
                    future.set_result(None)
                else:
                    peer.futures.append(future)
            case mb.Abort(room=name, reason=reason):
                room = self.rooms.get(name)
                if room is None:
                    return
                if room.state == TransferState.TRANSFERRING:
                    room.aborted = True  # the pair thread is writing its pages; report when it is done
                else:
                    self.fail(room, reason)
            case mb.Done():
                self.on_done(item)
            case mb.GroupDead(addr=addr, gen=gen, reason=reason):
                if addr in self.peers:
                    self.send(self.peers[addr], kc.PairDead(gen=gen, reason=reason))
            case mb.ToSender(addr=addr, msg=msg):
                if addr in self.peers:
                    self.send(self.peers[addr], msg)
            case _:
                raise TypeError(f"unexpected mailbox item on the receiver: {item!r}")

    def on_request(self, item: mb.Request) -> None:
        name = item.room
        if name in self.rooms:
            self.refuse(name, f"room {name} requested twice")
            return
        room = RecvRoom.enter(
            name,
            TransferState.BOOTSTRAPPING,
            self.cfg.bootstrap_timeout_s,
            started=item.t0,
            addr=item.addr,
            pages=item.pages,
            num_tokens=item.num_tokens,
            skip_pages=item.skip_pages,
            prefix_hash=item.prefix_hash,
        )
        self.enter(room)
        peer = self.peer_for(item.addr)
        if isinstance(peer, str):
            self.fail(room, peer)
        elif peer.ready:
            peer.last_used = time.monotonic()
            self.send_page_list(peer, room)
        else:
            peer.pending.append(name)

    def on_done(self, item: mb.Done) -> None:
        room = self.rooms.get(item.room)
        if room is None or room.state != TransferState.TRANSFERRING:
            return  # a drained transfer for a room that is already gone
        error = "aborted by decode" if room.aborted else item.error
        if error is None:
            self.finish(
                room,
                TransferState.SUCCESS,
                metadata=item.metadata,
                num_bytes=item.num_bytes,
                direct=item.direct,
                shm=item.shm,
            )
        else:
            self.finish(room, TransferState.FAILED, error=error, corrupt=item.corrupt and not room.aborted)

    # ---- events from prefill nodes ----------------------------------------------------------------

    def on_refused(self, peer: _Peer, error: ProtocolError) -> None:
        log.warning("kv_transfer: refused a frame from prefill %s: %s", peer.addr, error)
        if isinstance(error, VersionMismatch):
            # A prefill node of another release: no frame of it can be trusted, so no pair.
            self.drop_peer(peer, f"prefill {peer.addr} refused: {error}", FingerprintMismatch)

    def on_peer(self, peer: _Peer, msg: kc.Message) -> None:
        peer.last_used = time.monotonic()
        match msg:
            case kc.HelloAck():
                self.on_hello_ack(peer, msg)
            case kc.Build(gen=gen) if peer.pair is not None:
                peer.pair.build(gen, self.o.receiver_id)
            case kc.StoreSet() if peer.pair is not None:
                peer.pair.deliver(msg)
            case kc.Build() | kc.StoreSet():
                pass  # no pair yet
            case kc.Announce():
                self.on_announce(peer, msg)
            case kc.Abort() | kc.PrefixMismatch():
                self.on_room_refused(peer, msg)
            case kc.Bye(reason=reason):
                self.drop_peer(peer, f"prefill {peer.addr} closed the pair: {reason}")
            case _:
                log.warning("kv_transfer: unexpected %s from prefill %s", msg.kind, peer.addr)

    def on_room_refused(self, peer: _Peer, msg: kc.Abort | kc.PrefixMismatch) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.addr != peer.addr:
            return  # gone, or another peer's room of the same name
        if isinstance(msg, kc.PrefixMismatch):
            if room.state == TransferState.WAITING_FOR_INPUT:
                # No Abort: the prefill node keeps the room for the full page list that follows.
                error = f"prefix refused by prefill: {msg.reason}"
                self.finish(room, TransferState.FAILED, error=error, prefix_mismatch=True)
        elif msg.unknown_pair:
            self.rehandshake(peer)
        elif room.state != TransferState.TRANSFERRING:
            self.finish(room, TransferState.FAILED, error=f"prefill aborted: {msg.reason}")

    def on_hello_ack(self, peer: _Peer, msg: kc.HelloAck) -> None:
        if not msg.ok:
            exc_type = FingerprintMismatch if msg.mismatch else ConnectionError
            self.drop_peer(peer, f"prefill {peer.addr} refused the pair: {msg.error}", exc_type)
            return
        error = mapping_error(self.o._geometry.kv_heads, msg.tp_size, self.o._tp_size)
        if error is not None:
            self.drop_peer(peer, f"prefill {peer.addr}: {error}, pair refused", FingerprintMismatch)
            return
        host, _ = split_addr(peer.addr)
        if peer.pair is None:
            peer.pair = ReceiverPair(
                addr=peer.addr, peer_host=host, kv=self.o._kv, config=self.cfg, mailbox=self.o._mailbox
            )
        peer.pair.build(msg.gen, self.o.receiver_id)
        offer = None if self.o._kv.is_cuda else msg.shm
        mapped = map_segment(peer.addr, offer, msg.tp_size, self.o._geometry, self.cfg, self.shm_refusals)
        pools = self.o._rank_pools
        if self.o._tp_size > 1 and pools is None:  # a TP worker whose ranks' pools are not mapped here
            mapped = None
        dst = RankPools(pools or [self.o._kv], self.o._head_split)
        peer.shm = ShmReceive(peer.addr, dst, self.o._mailbox, mapped)
        peer.ready = True
        for future in peer.futures:
            if not future.done():
                future.set_result(None)
        peer.futures.clear()
        for name in peer.pending:
            room = self.rooms.get(name)
            if room is not None and room.state == TransferState.BOOTSTRAPPING:
                self.send_page_list(peer, room)
        peer.pending.clear()

    def on_announce(self, peer: _Peer, msg: kc.Announce) -> None:
        """Hand the room to the transport the announcement names (the room may be gone here: the
        transport then drains or refuses the data)."""
        if peer.pair is None or peer.shm is None:
            return  # no HelloAck yet: nothing was announced to this pair
        live = self.rooms.get(msg.room)
        if live is not None and (live.addr != peer.addr or live.state != TransferState.WAITING_FOR_INPUT):
            live = None
        if msg.shm_pages is None:
            self.hand_over(peer.pair, self.dist, live, msg)
        else:
            self.hand_over(peer.pair, peer.shm, live, msg)

    def hand_over(
        self, pair: ReceiverPair, transport: ReceiveTransport[J], live: RecvRoom | None, msg: kc.Announce
    ) -> None:
        job, error = transport.accept(live, msg)
        if live is not None and error is not None:
            self.fail(live, error)
        elif live is not None and job is not None:
            self.move(live, TransferState.TRANSFERRING)
        if job is not None:
            pair.submit(transport, job)

    def in_flight(self) -> bool:
        return bool(self.rooms) or any(not p.ready for p in self.peers.values())

    def on_timers(self, now: float) -> None:
        for peer in [p for p in self.peers.values() if not p.ready and now >= p.hello_deadline]:
            self.drop_peer(
                peer, f"no handshake reply from prefill {peer.addr} within {self.cfg.bootstrap_timeout_s}s"
            )
        for room in [r for r in self.rooms.values() if r.expired(now)]:
            if room.state == TransferState.WAITING_FOR_INPUT:
                self.fail(
                    room,
                    f"timed out after {self.cfg.waiting_timeout_s}s waiting for KV data from {room.addr}",
                )
            else:
                self.fail(
                    room, f"timed out after {self.cfg.bootstrap_timeout_s}s bootstrapping with {room.addr}"
                )
