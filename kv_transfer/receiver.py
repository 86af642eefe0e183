"""KVReceiver: the decode node's end of the KV hand-off.

Threads: the caller's (request/abort/poll never block; connect() does, by design, at registration), one
I/O thread that owns all room state and one pyzmq DEALER per prefill node, and one control thread per
pair (ReceiverPair) that builds the pair group and receives in the order the prefill node announces.

Pages given to request() belong to the transfer until poll() reports the room: on SUCCESS they hold the
prompt's KV (committed after the trailer's room id matched); on FAILED free them.

Same host (shm.py): when a prefill node's HelloAck offers its shared-memory segment and this node can
map it (same user, same host, the token read back), page lists say so, and the announced pages are
copied out of the mapping on the pair thread, then Copied tells the prefill node. A segment that cannot
be mapped means the pair group, as between hosts (logged once per reason).
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve.cluster_auth import secure_client
from pdserve.kv_transfer import mailbox as mb
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.endpoint import Endpoint
from pdserve.kv_transfer.handshake import FingerprintMismatch
from pdserve.kv_transfer.io_loop import EndpointIO, split_addr
from pdserve.kv_transfer.layout import runs_fit
from pdserve.kv_transfer.receiver_pair import ReceiverPair, RecvJob, ShmJob
from pdserve.kv_transfer.shm import MappedPool, ShmError
from pdserve.kv_transfer.state import RecvRoom, TransferResult, TransferState
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError, VersionMismatch
from pdserve.protocol.kv_trailer import FirstToken

log = logging.getLogger("pdserve.kv_transfer")


class KVReceiver(Endpoint):
    """Receives prompts' KV pages from prefill nodes into pre-allocated pages of the local pool."""

    def __init__(self, kv: Any, fingerprint: dict[str, str | int], config: TransferConfig) -> None:
        super().__init__(kv, fingerprint, config)
        self.receiver_id = uuid.uuid4().hex  # zmq identity and pair id; unique per process lifetime

    def start(self) -> None:
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._io_loop, name="kv-receiver-io", daemon=True)
        self._thread.start()

    def connect(self, prefill_addr: str, timeout_s: float | None = None) -> None:
        """Handshake with a prefill node now (blocking). Raises FingerprintMismatch if the pair is refused,
        TimeoutError if the node does not answer within bootstrap_timeout_s (or timeout_s)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._mailbox.post(mb.Connect(prefill_addr, future))
        future.result(timeout=timeout_s if timeout_s is not None else self._config.bootstrap_timeout_s + 5)

    def request(
        self,
        room: str,
        prefill_addr: str,
        dst_pages: list[int],
        num_tokens: int,
        skip_pages: int = 0,
        prefix_hash: int | None = None,
    ) -> None:
        """Ask the prefill node at prefill_addr to fill dst_pages with room's KV (num_tokens tokens).

        Incremental transfer: with `skip_pages`, this node holds the KV of the room's first
        `skip_pages` whole pages already (`prefix_hash`: the chained block hash of the last), and
        `dst_pages` are for the pages after them. If the prefill node's prompt starts otherwise,
        poll() reports FAILED with `prefix_mismatch` set: request the room again, in full."""
        if skip_pages and prefix_hash is None:
            raise ValueError("skipping pages needs the prefix hash")
        self._mailbox.post(
            mb.Request(
                room,
                prefill_addr,
                list(dst_pages),
                int(num_tokens),
                time.monotonic(),
                skip_pages=int(skip_pages),
                prefix_hash=prefix_hash,
            )
        )

    def abort(self, room: str) -> None:
        """Give up on `room`; its FAILED result still comes out of poll() (free the pages then)."""
        self._mailbox.post(mb.Abort(room, "aborted by decode"))

    def _io_loop(self) -> None:
        self._run_io(_ReceiverIO(self))


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
    shm: MappedPool | None = None  # the prefill node's pool, mapped: rooms are copied out of it


class _ReceiverIO(EndpointIO):
    """State owned by the receiver's I/O thread; every room transition happens here."""

    def __init__(self, owner: KVReceiver) -> None:
        super().__init__(owner._mailbox)
        self.o = owner
        self.cfg = owner._config
        self.peers: dict[str, _Peer] = {}
        self.by_sock: dict[zmq.Socket[bytes], _Peer] = {}
        self.rooms: dict[str, RecvRoom] = {}
        # Closed pairs whose threads may still be finishing; joined at shutdown so that no pair thread
        # is torn down inside a process group's destructor at interpreter exit.
        self.closing: list[ReceiverPair] = []
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
        for pair in self.closing:
            pair.join(timeout_s=2.0)

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
        self.send(peer, kc.Hello(receiver_id=self.o.receiver_id, identity=self.o._identity))
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
            peer.pair.close()
            self.closing = [p for p in self.closing if p.alive] + [peer.pair]

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

    def move(self, room: RecvRoom, state: TransferState, timeout_s: float | None = None) -> None:
        room.transition(state, timeout_s)
        self.o._states[room.room] = state

    def finish(
        self,
        room: RecvRoom,
        state: TransferState,
        metadata: FirstToken | None = None,
        error: str | None = None,
        num_bytes: int = 0,
        prefix_mismatch: bool = False,
        direct: bool = False,
        shm: bool = False,
    ) -> None:
        room.transition(state)
        self.rooms.pop(room.room, None)
        self.o._states.pop(room.room, None)
        self.o._publish(
            room.result(
                metadata=metadata,
                error=error,
                num_bytes=num_bytes,
                prefix_mismatch=prefix_mismatch,
                direct=direct,
                shm=shm,
            )
        )

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
                shm=peer.shm is not None,
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
            self.o._publish(
                TransferResult(name, TransferState.FAILED, None, f"room {name} requested twice", 0, 0.0)
            )
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
        self.rooms[name] = room
        self.o._states[name] = room.state
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
            self.finish(room, TransferState.FAILED, error=error)

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
            case kc.Build(gen=gen):
                if peer.pair is not None:
                    peer.pair.build(gen, self.o.receiver_id)
            case kc.Announce():
                self.on_announce(peer, msg)
            case kc.StoreSet(gen=gen, key=key, value=value):
                if peer.pair is not None:
                    peer.pair.stores.deliver(gen, key, base64.b64decode(value, validate=True))
            case kc.Abort(unknown_pair=True, room=name):
                room = self.rooms.get(name)
                if room is not None and room.addr == peer.addr:
                    self.rehandshake(peer)
            case kc.Abort(room=name, reason=reason):
                room = self.rooms.get(name)
                if room is not None and room.addr == peer.addr and room.state != TransferState.TRANSFERRING:
                    self.finish(room, TransferState.FAILED, error=f"prefill aborted: {reason}")
            case kc.PrefixMismatch(room=name, reason=reason):
                room = self.rooms.get(name)
                if (
                    room is not None
                    and room.addr == peer.addr
                    and room.state == TransferState.WAITING_FOR_INPUT
                ):
                    # No Abort: the prefill node keeps the room for the full page list that follows.
                    error = f"prefix refused by prefill: {reason}"
                    self.finish(room, TransferState.FAILED, error=error, prefix_mismatch=True)
            case kc.Bye(reason=reason):
                self.drop_peer(peer, f"prefill {peer.addr} closed the pair: {reason}")
            case _:
                log.warning("kv_transfer: unexpected %s from prefill %s", msg.kind, peer.addr)

    def on_hello_ack(self, peer: _Peer, msg: kc.HelloAck) -> None:
        if not msg.ok:
            exc_type = FingerprintMismatch if msg.mismatch else ConnectionError
            self.drop_peer(peer, f"prefill {peer.addr} refused the pair: {msg.error}", exc_type)
            return
        host, _ = split_addr(peer.addr)
        if peer.pair is None:
            peer.pair = ReceiverPair(
                addr=peer.addr,
                peer_host=host,
                kv=self.o._kv,
                geometry=self.o._geometry,
                config=self.cfg,
                mailbox=self.o._mailbox,
            )
        peer.pair.build(msg.gen, self.o.receiver_id)
        peer.shm = self.map_segment(peer, msg.shm)
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

    def map_segment(self, peer: _Peer, offer: kc.ShmOffer | None) -> MappedPool | None:
        """The prefill node's pool mapped from shared memory, or None: its rooms use the pair group."""
        if offer is None or self.cfg.transport == "dist" or self.o._kv.is_cuda:
            return None
        try:
            mapped = MappedPool.open(
                offer.path, bytes.fromhex(offer.token), offer.num_pages, self.o._geometry, self.cfg.shm_dir
            )
            log.info("kv_transfer: prefill %s: KV through shared memory (%s)", peer.addr, offer.path)
            return mapped
        except ShmError as exc:
            reason = str(exc)
            if self.cfg.transport == "shm":
                log.warning(
                    "kv_transfer: prefill %s: no shared memory, using the pair group: %s", peer.addr, reason
                )
            elif reason not in self.shm_refusals and len(self.shm_refusals) < 64:
                self.shm_refusals.add(reason)
                log.info(
                    "kv_transfer: prefill %s: no shared memory, using the pair group: %s", peer.addr, reason
                )
            return None

    def on_announce(self, peer: _Peer, msg: kc.Announce) -> None:
        if msg.shm_pages is not None:
            self.on_announce_shm(peer, msg)
            return
        # The room the data lands in; None: the pair drains the data and drops it.
        live = self.rooms.get(msg.room)
        if live is not None and (live.addr != peer.addr or live.state != TransferState.WAITING_FOR_INPUT):
            live = None
        if live is not None and msg.runs is not None and not runs_fit(live.pages[: msg.num_pages], msg.runs):
            # Never receive in place into pages outside a run: drain the data, fail the room.
            self.fail(live, "the prefill node announced page runs that do not match this node's page list")
            live = None
        if live is not None:
            self.move(live, TransferState.TRANSFERRING)
        job = RecvJob(
            room=msg.room,
            dst_pages=live.pages[: msg.num_pages] if live is not None else None,
            num_pages=msg.num_pages,
            chunk_pages=msg.chunk_pages,
            runs=msg.runs,
            seq=msg.seq,
            gen=msg.gen,
            trailer_len=msg.trailer_len,
        )
        if peer.pair is not None:
            peer.pair.submit(job)

    def on_announce_shm(self, peer: _Peer, msg: kc.Announce) -> None:
        """Copy the room's pages out of the prefill node's segment (on the pair thread, in announced
        order); a room gone here, or a segment never mapped, is answered at once with a failed Copied."""
        live = self.rooms.get(msg.room)
        if live is not None and (live.addr != peer.addr or live.state != TransferState.WAITING_FOR_INPUT):
            live = None
        error = ""
        if peer.shm is None:
            error = "shared-memory pages announced to a decode node that did not map the segment"
        elif live is None:
            error = f"room {msg.room} is gone on the decode node"
        elif msg.num_pages > len(live.pages):
            error = f"{msg.num_pages} pages announced for a page list of {len(live.pages)}"
        try:
            trailer = base64.b64decode(msg.trailer or "", validate=True)
        except (binascii.Error, ValueError):
            error = error or "unreadable shared-memory trailer"
        if error:
            if live is not None:
                self.fail(live, error)
            self.send(peer, kc.Copied(room=msg.room, seq=msg.seq, error=error))
            return
        assert live is not None and peer.shm is not None and peer.pair is not None
        self.move(live, TransferState.TRANSFERRING)
        peer.pair.submit(
            ShmJob(
                room=msg.room,
                seq=msg.seq,
                src=peer.shm,
                src_pages=msg.shm_pages or [],
                dst_pages=live.pages[: msg.num_pages],
                fence=msg.shm_fence,
                trailer=trailer,
            )
        )

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
