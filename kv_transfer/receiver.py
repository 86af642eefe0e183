"""KVReceiver: the decode node's end of the KV hand-off.

Threads: the caller's (request/abort/poll never block; connect() does, by design, at registration), one
I/O thread that owns all room state and one pyzmq DEALER per prefill node, and one control thread per
pair (ReceiverPair) that builds the pair group and receives in the order the prefill node announces.

Pages given to request() belong to the transfer until poll() reports the room: on SUCCESS they hold the
prompt's KV (committed after the trailer's room id matched); on FAILED free them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve.kv_transfer import control
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.endpoint import Endpoint
from pdserve.kv_transfer.handshake import FingerprintMismatch
from pdserve.kv_transfer.layout import runs_fit
from pdserve.kv_transfer.receiver_pair import ReceiverPair, RecvJob
from pdserve.kv_transfer.state import Room, TransferResult, TransferState

_TICK_S = 0.02


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
        self._mailbox.post(("connect", prefill_addr, future))
        future.result(timeout=timeout_s if timeout_s is not None else self._config.bootstrap_timeout_s + 5)

    def request(self, room: str, prefill_addr: str, dst_pages: list[int], num_tokens: int) -> None:
        """Ask the prefill node at prefill_addr to fill dst_pages with room's KV (num_tokens tokens)."""
        self._mailbox.post(
            ("request", room, prefill_addr, list(dst_pages), int(num_tokens), time.monotonic())
        )

    def abort(self, room: str) -> None:
        """Give up on `room`; its FAILED result still comes out of poll() (free the pages then)."""
        self._mailbox.post(("abort", room))

    def _io_loop(self) -> None:
        io = _ReceiverIO(self)
        try:
            io.run()
        finally:
            io.shutdown()


@dataclass
class _Peer:
    addr: str
    sock: zmq.Socket
    ready: bool = False
    hello_deadline: float = 0.0
    pair: ReceiverPair | None = None
    pending: list[str] = field(default_factory=list)  # rooms waiting for the handshake
    futures: list[concurrent.futures.Future] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    store_port: int = 0


class _ReceiverIO:
    """State owned by the receiver's I/O thread; every room transition happens here."""

    def __init__(self, owner: KVReceiver) -> None:
        self.o = owner
        self.cfg = owner._config
        self.poller = zmq.Poller()
        self.peers: dict[str, _Peer] = {}
        self.by_sock: dict[zmq.Socket, _Peer] = {}
        self.rooms: dict[str, Room] = {}
        # Closed pairs whose threads may still be finishing; joined at shutdown so that no pair thread
        # is torn down inside a process group's destructor at interpreter exit.
        self.closing: list[ReceiverPair] = []

    def run(self) -> None:
        self.poller.register(self.o._mailbox.fileno(), zmq.POLLIN)
        while True:
            events = dict(self.poller.poll(int(_TICK_S * 1000)))
            for sock in [s for s in events if isinstance(s, zmq.Socket)]:
                while sock in self.by_sock:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    control.guarded(self.on_peer, self.by_sock[sock], frame)
            for item in self.o._mailbox.drain():
                if item[0] == "close":
                    return
                control.guarded(self.on_local, item)
            self.on_timers(time.monotonic())

    def shutdown(self) -> None:
        for peer in list(self.peers.values()):
            self.send(peer, control.BYE, reason="decode node shutting down")
            self.drop_peer(peer, "receiver closed")
        for pair in self.closing:
            pair.join(timeout_s=2.0)

    def send(self, peer: _Peer, kind: str, **fields: Any) -> None:
        try:
            peer.sock.send(control.encode(kind, **fields), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer's own timers handle a lost message

    # ---- peers ---------------------------------------------------------------------------------

    def peer_for(self, addr: str) -> _Peer | str:
        """The peer for addr, saying HELLO if new; an error string if no pair slot is free."""
        peer = self.peers.get(addr)
        if peer is not None:
            return peer
        if len(self.peers) >= self.cfg.max_pairs:
            busy = {r.info["addr"] for r in self.rooms.values()}
            idle = [p for p in self.peers.values() if p.addr not in busy and not p.futures]
            if not idle:
                return f"decode node at its limit of {self.cfg.max_pairs} prefill pairs, all busy"
            victim = min(idle, key=lambda p: p.last_used)
            self.send(victim, control.BYE, reason="pair evicted (max_pairs)")
            self.drop_peer(victim, "evicted")
        sock = self.o._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.o.receiver_id.encode())
        host, port = control.split_addr(addr)
        sock.connect(f"tcp://{addr}" if ":" not in host else f"tcp://[{host}]:{port}")
        peer = _Peer(addr, sock, hello_deadline=time.monotonic() + self.cfg.bootstrap_timeout_s)
        self.peers[addr] = peer
        self.by_sock[sock] = peer
        self.poller.register(sock, zmq.POLLIN)
        self.send(peer, control.HELLO, receiver_id=self.o.receiver_id, identity=self.o._identity)
        return peer

    def drop_peer(self, peer: _Peer, reason: str, exc_type: type[Exception] = ConnectionError) -> None:
        """Forget a peer: fail its rooms that are not mid-transfer, close its socket and pair thread."""
        for room in [r for r in self.rooms.values() if r.info["addr"] == peer.addr]:
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
            r
            for r in self.rooms.values()
            if r.info["addr"] == peer.addr and r.state != TransferState.TRANSFERRING
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

    def move(self, room: Room, state: TransferState, timeout_s: float | None = None) -> None:
        room.transition(state, timeout_s)
        self.o._states[room.room] = state

    def finish(
        self,
        room: Room,
        state: TransferState,
        metadata: dict | None = None,
        error: str | None = None,
        num_bytes: int = 0,
    ) -> None:
        room.transition(state)
        self.rooms.pop(room.room, None)
        self.o._states.pop(room.room, None)
        self.o._results.append(room.result(metadata=metadata, error=error, num_bytes=num_bytes))

    def fail(self, room: Room, error: str) -> None:
        """Fail a room that is not mid-transfer and tell the prefill node (if it had the page list)."""
        peer = self.peers.get(room.info["addr"])
        if peer is not None and room.state == TransferState.WAITING_FOR_INPUT:
            self.send(peer, control.ABORT, room=room.room, reason=error)
        self.finish(room, TransferState.FAILED, error=error)

    def send_request(self, peer: _Peer, room: Room) -> None:
        info = room.info
        self.send(peer, control.REQUEST, room=room.room, pages=info["pages"], num_tokens=info["num_tokens"])
        self.move(room, TransferState.WAITING_FOR_INPUT, self.cfg.waiting_timeout_s)

    # ---- events -----------------------------------------------------------------------------------

    def on_local(self, item: tuple) -> None:
        kind = item[0]
        if kind == "request":
            _, name, addr, pages, num_tokens, t0 = item
            if name in self.rooms:
                self.o._results.append(
                    TransferResult(name, TransferState.FAILED, None, f"room {name} requested twice", 0, 0.0)
                )
                return
            room = Room.enter(name, TransferState.BOOTSTRAPPING, self.cfg.bootstrap_timeout_s, started=t0)
            room.info.update(addr=addr, pages=pages, num_tokens=num_tokens)
            self.rooms[name] = room
            self.o._states[name] = room.state
            peer = self.peer_for(addr)
            if isinstance(peer, str):
                self.fail(room, peer)
            elif peer.ready:
                peer.last_used = time.monotonic()
                self.send_request(peer, room)
            else:
                peer.pending.append(name)
        elif kind == "connect":
            _, addr, future = item
            peer = self.peer_for(addr)
            if isinstance(peer, str):
                future.set_exception(ConnectionError(peer))
            elif peer.ready:
                future.set_result(None)
            else:
                peer.futures.append(future)
        elif kind == "abort":
            room = self.rooms.get(item[1])
            if room is None:
                return
            if room.state == TransferState.TRANSFERRING:
                room.aborted = True  # the pair thread is writing its pages; report when it is done
            else:
                self.fail(room, "aborted by decode")
        elif kind == "done":
            _, name, error, metadata, num_bytes = item
            room = self.rooms.get(name)
            if room is None or room.state != TransferState.TRANSFERRING:
                return  # a drained transfer for a room that is already gone
            if room.aborted:
                error = "aborted by decode"
            if error is None:
                self.finish(room, TransferState.SUCCESS, metadata=metadata, num_bytes=num_bytes)
            else:
                self.finish(room, TransferState.FAILED, error=error)
        elif kind == "dead":
            _, addr, gen, reason = item
            peer = self.peers.get(addr)
            if peer is not None:
                self.send(peer, control.PAIR_DEAD, gen=gen, reason=reason)

    def on_peer(self, peer: _Peer, frame: bytes) -> None:
        try:
            msg = control.decode(frame)
        except ValueError:
            return
        kind = msg["t"]
        peer.last_used = time.monotonic()
        if kind == control.HELLO_ACK:
            if not msg["ok"]:
                exc_type = FingerprintMismatch if msg.get("mismatch") else ConnectionError
                self.drop_peer(peer, f"prefill {peer.addr} refused the pair: {msg['error']}", exc_type)
                return
            host, _ = control.split_addr(peer.addr)
            if peer.pair is None:
                peer.pair = ReceiverPair(
                    addr=peer.addr,
                    store_host=host,
                    kv=self.o._kv,
                    geometry=self.o._geometry,
                    config=self.cfg,
                    mailbox=self.o._mailbox,
                )
            peer.store_port = int(msg["store_port"])
            peer.pair.build(int(msg["gen"]), peer.store_port, self.o.receiver_id)
            peer.ready = True
            for future in peer.futures:
                if not future.done():
                    future.set_result(None)
            peer.futures.clear()
            for name in peer.pending:
                room = self.rooms.get(name)
                if room is not None and room.state == TransferState.BOOTSTRAPPING:
                    self.send_request(peer, room)
            peer.pending.clear()
        elif kind == control.BUILD:
            if peer.pair is not None:
                peer.pair.build(int(msg["gen"]), peer.store_port, self.o.receiver_id)
        elif kind == control.ANNOUNCE:
            self.on_announce(peer, msg)
        elif kind == control.ABORT:
            room = self.rooms.get(msg["room"])
            if msg.get("unknown_pair"):
                if room is not None and room.info["addr"] == peer.addr:
                    self.rehandshake(peer)
                return
            if (
                room is not None
                and room.info["addr"] == peer.addr
                and room.state != TransferState.TRANSFERRING
            ):
                self.finish(room, TransferState.FAILED, error=f"prefill aborted: {msg.get('reason', '')}")
        elif kind == control.BYE:
            self.drop_peer(peer, f"prefill {peer.addr} closed the pair: {msg.get('reason', '')}")

    def on_announce(self, peer: _Peer, msg: dict) -> None:
        room = self.rooms.get(msg["room"])
        num_pages = int(msg["num_pages"])
        runs = _runs(msg.get("runs"), num_pages)
        live = (
            room is not None
            and room.info["addr"] == peer.addr
            and room.state == TransferState.WAITING_FOR_INPUT
        )
        if live and runs is not None and not runs_fit(room.info["pages"][:num_pages], runs):
            # Never receive in place into pages outside a run: drain the data, fail the room.
            self.fail(room, "the prefill node announced page runs that do not match this node's page list")
            live = False
        if live:
            self.move(room, TransferState.TRANSFERRING)
        job = RecvJob(
            room=msg["room"],
            dst_pages=room.info["pages"][:num_pages] if live else None,
            num_pages=num_pages,
            chunk_pages=int(msg["chunk_pages"]),
            runs=runs,
            seq=int(msg["seq"]),
            gen=int(msg["gen"]),
            trailer_len=int(msg["trailer_len"]),
        )
        if peer.pair is not None:
            peer.pair.submit(job)

    def on_timers(self, now: float) -> None:
        for peer in [p for p in self.peers.values() if not p.ready and now >= p.hello_deadline]:
            self.drop_peer(
                peer, f"no handshake reply from prefill {peer.addr} within {self.cfg.bootstrap_timeout_s}s"
            )
        for room in [r for r in self.rooms.values() if r.expired(now)]:
            if room.state == TransferState.WAITING_FOR_INPUT:
                self.fail(
                    room,
                    f"timed out after {self.cfg.waiting_timeout_s}s waiting for KV data from {room.info['addr']}",
                )
            else:
                self.fail(
                    room,
                    f"timed out after {self.cfg.bootstrap_timeout_s}s bootstrapping with {room.info['addr']}",
                )


def _runs(value: Any, num_pages: int) -> list[int] | None:
    """The announced pool-to-pool pieces; they must cover exactly num_pages pages."""
    if value is None:
        return None
    runs = [int(n) for n in value]
    if any(n < 1 for n in runs) or sum(runs) != num_pages:
        raise ValueError(f"announced runs {runs[:8]}... do not cover {num_pages} pages")
    return runs
