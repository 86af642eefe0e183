"""KVSender: the prefill node's end of the KV hand-off.

Threads: the caller's (send/abort/poll only post to a mailbox or read a deque, never block), one I/O
thread that owns all room state and the pyzmq ROUTER bootstrap socket, and one control thread per pair
(SenderPair) that builds the pair's process group and runs its transfers in order.

A room's data moves once both halves are known: send() from the prefill worker (pages, metadata) and
the decode's REQUEST (its page list), in either order. Pages given to send() stay in use until poll()
reports the room (SUCCESS or FAILED); free them then, not before.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from datetime import timedelta
from typing import Any

import zmq
from torch._C._distributed_c10d import TCPStore

from pdserve.kv_transfer import control
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.endpoint import Endpoint
from pdserve.kv_transfer.handshake import compare_identities
from pdserve.kv_transfer.layout import pages_for
from pdserve.kv_transfer.sender_pair import SenderPair, SendJob
from pdserve.kv_transfer.state import Room, TransferResult, TransferState

_TICK_S = 0.02  # timer resolution of the I/O thread
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
    ) -> None:
        super().__init__(kv, fingerprint, config)
        self._host, self._port = host, bootstrap_port
        self._errors: collections.deque[str] = collections.deque(maxlen=64)
        self._store: TCPStore | None = None
        self.addr = ""

    # ---- public interface (any thread, non-blocking) ------------------------------------

    def start(self) -> None:
        """Bind the bootstrap ROUTER and host the pair groups' TCPStore; start the I/O thread."""
        self._store = TCPStore(
            self._host,
            0,
            None,
            True,
            timedelta(seconds=self._config.bootstrap_timeout_s),
            wait_for_workers=False,
        )
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
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

    def send(self, room: str, src_pages: list[int], num_tokens: int, metadata: dict) -> None:
        """The prefill of `room` is done: send its pages once the decode's page list is here."""
        self._mailbox.post(("send", room, list(src_pages), int(num_tokens), dict(metadata), time.monotonic()))

    def abort(self, room: str) -> None:
        """Give up on `room`; its FAILED result still comes out of poll() (free the pages then)."""
        self._mailbox.post(("abort", room, "aborted by prefill"))

    def handshake_errors(self) -> list[str]:
        """Recent refused handshakes (fingerprint mismatches, too many pairs), oldest first."""
        return list(self._errors)

    def close(self) -> None:
        super().close()
        self._store = None

    # ---- I/O thread ---------------------------------------------------------------------------

    def _io_loop(self, router: zmq.Socket) -> None:
        io = _SenderIO(self, router)
        try:
            io.run()
        finally:
            io.shutdown()
            router.close(linger=0)


class _SenderIO:
    """State owned by the sender's I/O thread; every room transition happens here."""

    def __init__(self, owner: KVSender, router: zmq.Socket) -> None:
        self.o = owner
        self.cfg = owner._config
        self.router = router
        self.rooms: dict[str, Room] = {}
        self.requests: dict[str, tuple[bytes, list[int], int, float]] = {}  # room -> (peer, pages, tokens, t)
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

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.o._mailbox.fileno(), zmq.POLLIN)
        while True:
            events = dict(poller.poll(int(_TICK_S * 1000)))
            if self.router in events:
                while True:
                    try:
                        identity, frame = self.router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    control.guarded(self.on_peer, identity, frame)
            for item in self.o._mailbox.drain():
                if item[0] == "close":
                    return
                control.guarded(self.on_local, item)
            self.on_timers(time.monotonic())

    def shutdown(self) -> None:
        for pair in list(self.pairs.values()):
            self.to_peer(pair.identity, control.BYE, reason="prefill node shutting down")
            self.close_pair(pair)
        for pair in self.closing:
            pair.join(timeout_s=2.0)

    def close_pair(self, pair: SenderPair) -> None:
        pair.close()
        self.pairs.pop(pair.identity, None)
        self.closing = [p for p in self.closing if p.alive] + [pair]

    def to_peer(self, identity: bytes, kind: str, **fields: Any) -> None:
        self.send_raw(identity, control.encode(kind, **fields))

    def send_raw(self, identity: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or its queue full; its own timers handle the rest

    # ---- room lifecycle -----------------------------------------------------------------

    def finish(self, room: Room, state: TransferState, error: str | None = None, num_bytes: int = 0) -> None:
        room.transition(state)
        self.rooms.pop(room.room, None)
        self.o._states.pop(room.room, None)
        self.remember(room.room, error or "success")
        self.o._results.append(room.result(metadata=None, error=error, num_bytes=num_bytes))

    def remember(self, name: str, outcome: str) -> None:
        self.finished[name] = outcome
        while len(self.finished) > _FINISHED_MEMORY:
            self.finished.popitem(last=False)

    def fail(self, room: Room, error: str) -> None:
        peer = room.info.get("peer")
        if peer is not None:
            self.to_peer(peer, control.ABORT, room=room.room, reason=error)
        self.finish(room, TransferState.FAILED, error)

    def move(self, room: Room, state: TransferState, timeout_s: float | None = None) -> None:
        room.transition(state, timeout_s)
        self.o._states[room.room] = state

    def dispatch(self, room: Room, peer: bytes, dst_pages: list[int], dst_tokens: int) -> None:
        """Both halves known: validate and queue the transfer on the pair's thread."""
        room.info["peer"] = peer
        num_tokens = room.info["num_tokens"]
        n_pages = pages_for(num_tokens, self.o._geometry.page_size)
        pair = self.pairs.get(peer)
        error = None
        if pair is None:
            error = "the decode node's pair was closed before the transfer"
        elif dst_tokens != num_tokens:
            error = f"token count mismatch: prefill has {num_tokens}, decode expects {dst_tokens}"
        elif len(room.info["src_pages"]) < n_pages or len(dst_pages) < n_pages:
            error = (
                f"{num_tokens} tokens need {n_pages} pages; prefill gave {len(room.info['src_pages'])}, "
                f"decode gave {len(dst_pages)}"
            )
        if error is not None:
            self.fail(room, error)
            return
        job = SendJob(
            room.room,
            room.info["src_pages"][:n_pages],
            dst_pages[:n_pages],
            num_tokens,
            room.info["metadata"],
        )
        room.info["job"] = job
        self.move(room, TransferState.BOOTSTRAPPING)  # pair thread reports "started" -> TRANSFERRING
        pair.submit(job)

    # ---- events --------------------------------------------------------------------------

    def on_local(self, item: tuple) -> None:
        kind = item[0]
        if kind == "send":
            _, name, pages, num_tokens, metadata, t0 = item
            if name in self.rooms or name in self.finished:
                outcome = "in progress" if name in self.rooms else self.finished[name]
                error = f"room {name} cannot be sent: already {outcome}"
                self.o._results.append(TransferResult(name, TransferState.FAILED, None, error, 0, 0.0))
                return
            room = Room.enter(name, TransferState.WAITING_FOR_INPUT, self.cfg.waiting_timeout_s, started=t0)
            room.info.update(src_pages=pages, num_tokens=num_tokens, metadata=metadata)
            self.rooms[name] = room
            self.o._states[name] = room.state
            req = self.requests.pop(name, None)
            if req is not None:
                self.dispatch(room, req[0], req[1], req[2])
        elif kind == "abort":
            self.abort(item[1], item[2])
        elif kind == "out":
            self.send_raw(item[1], item[2])
        elif kind == "started":
            room = self.rooms.get(item[1])
            if room is not None and room.state == TransferState.BOOTSTRAPPING:
                self.move(room, TransferState.TRANSFERRING)
        elif kind == "done":
            _, name, error, num_bytes = item
            room = self.rooms.get(name)
            if room is None:
                return
            pair = self.pairs.get(room.info.get("peer", b""))
            if pair is not None:
                pair.inflight -= 1
                pair.last_used = time.monotonic()
            if room.aborted:
                error = room.info.get("abort_reason", "aborted")
            if error is None:
                self.finish(room, TransferState.SUCCESS, num_bytes=num_bytes)
            else:
                self.fail(room, error)

    def abort(self, name: str, reason: str) -> None:
        self.requests.pop(name, None)
        room = self.rooms.get(name)
        if room is None:
            self.remember(name, reason)  # a send() that comes later fails at once
            return
        if room.state == TransferState.WAITING_FOR_INPUT:
            self.fail(room, reason)
            return
        # Queued or running on the pair thread: its "done" event reports the room.
        room.aborted = True
        room.info["abort_reason"] = reason
        room.info["job"].cancelled.set()

    def on_peer(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = control.decode(frame)
        except ValueError:
            return
        kind = msg["t"]
        if kind == control.HELLO:
            self.on_hello(identity, msg)
        elif kind == control.REQUEST:
            name = msg["room"]
            if identity not in self.pairs:
                # A decode node that paired with an earlier process at this address (this node
                # restarted): `unknown_pair` tells it to handshake again and resend the page list.
                self.to_peer(
                    identity,
                    control.ABORT,
                    room=name,
                    reason="page list before a handshake",
                    unknown_pair=True,
                )
                return
            self.pairs[identity].last_used = time.monotonic()
            room = self.rooms.get(name)
            if room is not None and room.state == TransferState.WAITING_FOR_INPUT:
                self.dispatch(room, identity, list(msg["pages"]), int(msg["num_tokens"]))
            elif room is not None:
                self.to_peer(
                    identity, control.ABORT, room=name, reason=f"room {name} already has a page list"
                )
            elif name in self.finished:
                reason = f"room {name} already finished on the prefill node: {self.finished[name]}"
                self.to_peer(identity, control.ABORT, room=name, reason=reason)
            else:
                self.requests[name] = (identity, list(msg["pages"]), int(msg["num_tokens"]), time.monotonic())
        elif kind == control.ABORT:
            self.abort(msg["room"], f"aborted by decode: {msg.get('reason', '')}")
        elif kind == control.PAIR_DEAD:
            pair = self.pairs.get(identity)
            if pair is not None:
                pair.discard_gen = int(msg["gen"])
        elif kind == control.BYE:
            pair = self.pairs.get(identity)
            if pair is not None:
                self.close_pair(pair)

    def on_hello(self, identity: bytes, msg: dict) -> None:
        error = compare_identities(self.o._identity, msg.get("identity", {}), "decode")
        mismatch = error is not None
        if error is None and identity not in self.pairs and not self.make_room_for_pair():
            error = f"prefill node at its limit of {self.cfg.max_pairs} pairs, all busy"
        if error is not None:
            self.o._errors.append(f"refused decode {identity.decode(errors='replace')}: {error}")
            self.to_peer(identity, control.HELLO_ACK, ok=False, mismatch=mismatch, error=error)
            return
        pair = self.pairs.get(identity)
        if pair is None:
            pair = SenderPair(
                identity=identity,
                kv=self.o._kv,
                geometry=self.o._geometry,
                store_host=self.o._host,
                store_port=self.o._store.port,
                config=self.cfg,
                mailbox=self.o._mailbox,
                gens=self.next_gen,
            )
            self.pairs[identity] = pair
        gen = pair.new_gen()
        pair.build(gen)
        self.to_peer(identity, control.HELLO_ACK, ok=True, error="", store_port=self.o._store.port, gen=gen)

    def make_room_for_pair(self) -> bool:
        """Close the least recently used idle pair if at the limit. False if every pair is busy."""
        if len(self.pairs) < self.cfg.max_pairs:
            return True
        busy = {req[0] for req in self.requests.values()} | {r.info.get("peer") for r in self.rooms.values()}
        idle = [p for p in self.pairs.values() if p.inflight == 0 and p.identity not in busy]
        if not idle:
            return False
        victim = min(idle, key=lambda p: p.last_used)
        self.to_peer(victim.identity, control.BYE, reason="pair evicted (max_pairs)")
        self.close_pair(victim)
        return True

    def on_timers(self, now: float) -> None:
        for room in [r for r in self.rooms.values() if r.expired(now)]:
            self.fail(
                room, f"timed out after {self.cfg.waiting_timeout_s}s waiting for the decode's page list"
            )
        ttl = self.cfg.orphan_request_ttl_s
        for name in [n for n, req in self.requests.items() if now - req[3] > ttl]:
            del self.requests[name]
