"""The control plane: one zmq ROUTER socket, the registration/heartbeat protocol, and the rooms in flight.

Three asyncio tasks share the socket: `_recv_loop` (every inbound frame), `_send_loop` (the only
writer, fed by a queue so sends can be issued from `finally` blocks and sync code), and
`_heartbeat_loop` (Ping every interval; a worker silent for `heartbeat_timeout_s` is removed and the
requests that still need it fail). Silence is counted on `LivenessClock` (liveness.py): only time the
event loop was responsive, so a stall of the gateway's own never removes a live worker. Worker outputs
go to the request's `Room` by room id (rooms.py); answers to the commands the gateway sends (cache
flushes, weight updates) to their waits (answers.py).

Trust: with a cluster secret the socket runs CurveZMQ and admits only peers holding the secret
(pdserve/cluster_auth.py). Even among those, a worker speaks only for itself: it is known by the zmq
identity of the connection that registered it (registration.py), so
  - a Register for a worker id held by another live connection is refused (retry later);
  - a Deregister counts only from the connection that registered that id;
  - outputs (TokenBatch, PrefillDone, RequestFailed) for a room count only from the worker the
    room's leg was routed to (`Room.prefill`, `Room.decode`); anyone else's are dropped.
When a room closes, the legs named are aborted, on a worker lost to the heartbeat too (it may be
alive, only slow): no generation stays queued on a worker nobody waits for. A prefill leg whose
PrefillDone never came is aborted whenever the decode leg ends, so its pages are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdserve.cluster_auth import ClusterKeys, load_keys, secure_server, start_authenticator, warn_if_open
from pdserve.gateway.cluster.answers import Answers
from pdserve.gateway.cluster.liveness import LivenessClock
from pdserve.gateway.cluster.registration import Refusal, refusal
from pdserve.gateway.cluster.role_switch import SWITCH_TIMEOUT_S, RoleSwitches, Switch
from pdserve.gateway.cluster.rooms import (
    Room,
    RoomAborted,
    deliver_failure,
    deliver_prefill_done,
    deliver_tokens,
    fail_rooms_of,
)
from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.protocol.codec import ProtocolError, VersionMismatch
from pdserve.protocol.gateway import (
    AbortRequest,
    Deregister,
    FlushCache,
    FlushCacheDone,
    KVEvents,
    Message,
    Ping,
    Pong,
    PrefillDone,
    Register,
    RegisterAck,
    RequestFailed,
    Role,
    SwitchRole,
    TokenBatch,
    WeightsCommand,
    WeightsReply,
    decode,
    encode,
)
from pdserve.protocol.vocabulary import AbortReason, FailCode

log = logging.getLogger(__name__)

# The largest control frame accepted: a KVEvents snapshot of a big prefix cache fits many times over.
# A bigger frame drops the connection (zmq MAXMSGSIZE) before any of it is buffered.
MAX_FRAME_BYTES = 16 << 20


class ControlPlane:
    def __init__(
        self,
        cfg: GatewayConfig,
        registry: WorkerRegistry,
        metrics: GatewayMetrics,
        keys: ClusterKeys | None = None,
    ) -> None:
        """`keys`: the cluster's Curve keys; default: from cfg.cluster_secret_file or the environment."""
        self.cfg = cfg
        self.keys = keys if keys is not None else load_keys(cfg.cluster_secret_file)
        self._auth: zmq.auth.base.Authenticator | None = None
        self.registry = registry
        self.metrics = metrics
        self.liveness = LivenessClock(cfg.heartbeat_interval_s)
        self.rooms: dict[str, Room] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._outbox: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.bound_port: int | None = None
        self.answers = Answers(registry, self.send)
        self.switches = RoleSwitches(registry, SWITCH_TIMEOUT_S)
        # Called with each worker accepted by a Register (gateway/cluster/weights.py: bring it to the cluster's weights).
        self.on_registered: list[Callable[[WorkerInfo], None]] = []

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        if self.keys is not None:
            self._auth = start_authenticator(self._ctx, self.keys)
        warn_if_open(self.keys, "the control plane")
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A worker's link that reconnects (a dropped TCP connection) keeps its identity: let the new
        # connection take over. Identities are per process, so no other worker can claim one.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        secure_server(sock, self.keys, MAX_FRAME_BYTES)
        addr = f"tcp://{self.cfg.control_host}:{self.cfg.control_port}"
        if self.cfg.control_port == 0:
            self.bound_port = sock.bind_to_random_port(f"tcp://{self.cfg.control_host}")
        else:
            sock.bind(addr)
            self.bound_port = self.cfg.control_port
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="gateway-recv"),
            asyncio.create_task(self._send_loop(), name="gateway-send"),
            asyncio.create_task(self._heartbeat_loop(), name="gateway-heartbeat"),
        ]
        log.info(
            "control plane listening on %s:%d (%s)",
            self.cfg.control_host,
            self.bound_port,
            "CurveZMQ, cluster secret" if self.keys is not None else "unauthenticated",
        )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        for room in list(self.rooms.values()):
            room.inbox.put_nowait(RoomAborted(FailCode.SHUTDOWN, "the gateway is shutting down"))
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = None

    # ---- sending -----------------------------------------------------------------------------

    def switch_role(self, worker_id: str, role: Role) -> Switch:
        """Start moving a worker to `role` in place (gateway/cluster/role_switch.py; raises SwitchRefused)."""
        s = self.switches.begin(worker_id, role)
        w = self.registry.get(worker_id)
        assert w is not None
        self.send(w, SwitchRole(role=role, epoch=s.epoch))
        self._update_worker_gauges()
        return s

    def send(self, worker: WorkerInfo, msg: Message) -> None:
        """Queue a message for a worker; never blocks, safe in `finally` blocks."""
        self._outbox.put_nowait((worker.identity, encode(msg)))

    async def _send_loop(self) -> None:
        assert self._sock is not None
        while True:
            identity, frame = await self._outbox.get()
            try:
                await self._sock.send_multipart([identity, frame])
            except zmq.ZMQError as e:
                log.warning("send to %r failed: %s", identity, e)

    # ---- rooms -------------------------------------------------------------------------------

    def open_room(
        self, room_id: str, prefill: WorkerInfo | None, decode: WorkerInfo | None, tokens: int, rid: str = ""
    ) -> Room:
        if prefill is None and decode is None:
            raise ValueError("a room needs a prefill or a decode leg")
        room = Room(room_id, prefill, decode, tokens, rid=rid)
        for worker in (prefill, decode):
            if worker is not None:
                self.registry.acquire(worker, tokens)
        self.rooms[room_id] = room
        return room

    def abort_rids(self, rid: str | None) -> int:
        """End the rooms of request `rid` (its n samples `rid-k` too), or every room for None, with
        `FailCode.CLIENT_ABORT`; the generations abort both legs on their way out."""
        hit = 0
        for room in list(self.rooms.values()):
            if rid is None or room.rid == rid or room.rid.startswith(f"{rid}-"):
                room.inbox.put_nowait(RoomAborted(FailCode.CLIENT_ABORT, "aborted by /abort_request"))
                hit += 1
        return hit

    def close_room(
        self, room: Room, abort_decode: AbortReason | None = None, abort_prefill: AbortReason | None = None
    ) -> None:
        """Forget the room, release its reserved work, and abort the legs named with a reason. The
        decode leg has ended here whatever the reason: a prefill leg that never reported PrefillDone
        is aborted too (its pages are freed)."""
        if self.rooms.pop(room.room, None) is None:
            return
        if room.prefill_done is None and room.prefill is not None:
            self.registry.release(room.prefill, room.tokens)
            abort_prefill = abort_prefill or AbortReason.DECODE_ENDED
        if room.decode is not None:
            self.registry.release(room.decode, room.tokens)
        for worker, reason in ((room.decode, abort_decode), (room.prefill, abort_prefill)):
            # Sent to a worker lost to the heartbeat as well: if it lives on, it stops the work; if it
            # is gone, the ROUTER drops the frame.
            if worker is not None and reason is not None:
                self.send(worker, AbortRequest(room=room.room, reason=reason))
                self.metrics.aborted_legs.labels(worker.role, reason).inc()

    # ---- receiving ---------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            t_recv = time.time()
            try:
                self._handle(frames, t_recv)
            except Exception:  # one bad frame must never stop the loop
                log.exception("error handling a control frame from %r", frames[0] if frames else None)

    def _handle(self, frames: list[bytes], t_recv: float) -> None:
        if len(frames) != 2:
            # A DEALER's frame arrives as [identity, payload]: anything else is not one of ours.
            log.warning("dropping a %d-part control message from %r", len(frames), frames[0][:64])
            return
        identity, payload = frames
        try:
            msg = decode(payload)
        except ProtocolError as e:
            log.warning("refused a frame from %r: %s", identity, e)
            if isinstance(e, VersionMismatch) and e.kind == "register":
                # A worker of another release: tell it why, in our version.
                self._outbox.put_nowait((identity, encode(RegisterAck(accepted=False, reason=str(e)))))
            return
        if isinstance(msg, Register):
            self._on_register(identity, msg, t_recv)
            return
        worker = self.registry.by_identity(identity)
        if worker is None and (retired := self.switches.retired(identity)) is not None:
            # A frame of a role the worker has left: never taken for its new role's.
            log.warning("%s from %s of stale epoch %d dropped", msg.kind, retired[0], retired[1])
            self.metrics.stale_epoch_frames.inc()
            return
        if worker is None:
            # Not pinged any more, the worker re-registers by itself once it hears nothing.
            log.warning("%s from unregistered peer %r dropped", msg.kind, identity)
            return
        worker.last_seen = self.liveness.now()
        self._from_worker(worker, msg, t_recv)

    def _from_worker(self, worker: WorkerInfo, msg: Message, t_recv: float) -> None:
        """A message from a registered worker."""
        if isinstance(msg, Pong):
            self._on_pong(worker, msg, t_recv)
        elif isinstance(msg, TokenBatch):
            deliver_tokens(self.rooms, worker, msg, t_recv)
        elif isinstance(msg, PrefillDone):
            deliver_prefill_done(self.rooms, worker, msg, t_recv, self.registry)
        elif isinstance(msg, RequestFailed):
            # A room closed already: the echo of the gateway's own abort (the client left), not a failure.
            if msg.code in (FailCode.TRANSFER, FailCode.KV_CORRUPT) and msg.room in self.rooms:
                self.metrics.transfer_failures.inc()
            deliver_failure(self.rooms, worker, msg)
        elif isinstance(msg, KVEvents):
            worker.prefix.apply(msg)
        elif isinstance(msg, (WeightsReply, FlushCacheDone)):
            self.answers.answered(worker, msg)
        elif isinstance(msg, Deregister):
            if msg.worker_id != worker.worker_id:
                log.warning("%s sent a deregister for %s: ignored", worker.worker_id, msg.worker_id)
                return
            log.info("worker %s is draining: out of rotation for new requests", worker.worker_id)
            worker.draining = True
            self._update_worker_gauges()
        else:
            log.warning("unexpected %s from worker %s", msg.kind, worker.worker_id)

    def _on_register(self, identity: bytes, reg: Register, t_recv: float) -> None:
        stale, switch = self.switches.check_register(reg)
        refused = (
            Refusal(stale)
            if stale is not None
            else refusal(
                self.cfg, self.registry, identity, reg, self.liveness.now(), self._ping, switch is not None
            )
        )
        if refused is not None:
            ack = RegisterAck(accepted=False, reason=refused.reason, retry=refused.retry)
            self._outbox.put_nowait((identity, encode(ack)))
            return
        old = self.registry.get(reg.worker_id)
        if old is not None:
            # Same id again: a restarted worker has lost whatever it held; a switched one has finished
            # what it held, unless its drain ran out of time.
            why = f"switched to {reg.role}" if switch is not None else "re-registered (restarted)"
            fail_rooms_of(self.rooms, old, f"{old.role} worker {old.worker_id} {why}")
            self.answers.end_waits_on(old, why)
        w = self.registry.add(reg, identity, self.liveness.now(), restart=switch is None)
        w.clock.add_one_way(reg.t_send, t_recv)
        if switch is not None:
            self.switches.completed(switch, old)
            self.metrics.role_switches.labels(switch.from_role, switch.to_role).inc()
            self.metrics.worker_gone(reg.worker_id, switch.from_role)
        log.info("worker %s registered as %s (%s)", reg.worker_id, reg.role, reg.bootstrap_addr or "-")
        self._outbox.put_nowait((identity, encode(RegisterAck(accepted=True))))
        # A first round trip right away so the offset estimate does not wait a heartbeat interval.
        self._ping(w)
        self._update_worker_gauges()
        for hook in self.on_registered:
            hook(w)

    def _ping(self, w: WorkerInfo) -> None:
        self.send(w, Ping(t0=time.time()))

    def _on_pong(self, w: WorkerInfo, pong: Pong, t_recv: float) -> None:
        w.clock.add_round_trip(pong.t0, pong.t1, pong.t2, t_recv)
        w.queued, w.running, w.free_tokens = pong.queued, pong.running, pong.free_tokens
        if pong.draining and not w.draining:
            log.info("worker %s reports draining", w.worker_id)
            w.draining = True
            self._update_worker_gauges()
        self.metrics.worker_load(
            w.worker_id,
            w.role,
            pong.queued,
            pong.running,
            pong.free_tokens,
            w.clock.offset,
            w.clock.rtt or 0.0,
        )

    async def flush_caches(self, timeout_s: float = 10.0) -> dict[str, str]:
        """Ask every registered worker (both roles keep a prefix cache) to empty it; returns the
        refusals (worker id -> why). Each worker then publishes the removal in its KVEvents."""
        sends = {w.worker_id: (w, FlushCache(flush_id=uuid.uuid4().hex)) for w in self.registry.all()}
        answers = await self.answers.ask(dict(sends), timeout_s)
        return {
            wid: a if isinstance(a, str) else a.message
            for wid, a in answers.items()
            if isinstance(a, str) or not a.ok
        }

    async def ask_weights(
        self, commands: dict[str, tuple[WorkerInfo, WeightsCommand]], timeout_s: float
    ) -> dict[str, WeightsReply]:
        """`ask` with weights commands (every op_id distinct); a worker that gave no answer gets a
        failed reply saying why."""
        answers = await self.answers.ask(dict(commands), timeout_s)
        out: dict[str, WeightsReply] = {}
        for wid, a in answers.items():
            if isinstance(a, WeightsReply):
                out[wid] = a
            else:
                out[wid] = WeightsReply(op_id=commands[wid][1].op_id, ok=False, message=str(a))
        return out

    # ---- liveness ----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            self.liveness.tick()
            self.check_liveness()
            for w in self.registry.all():
                self._ping(w)
            await asyncio.sleep(self.cfg.heartbeat_interval_s)

    def check_liveness(self) -> None:
        for w in self.registry.expired(self.liveness.now(), self.cfg.heartbeat_timeout_s):
            timeout = self.cfg.heartbeat_timeout_s
            log.error("worker %s (%s) sent nothing for %.1f s: removed", w.worker_id, w.role, timeout)
            self.registry.mark_down(w.worker_id, time.monotonic())  # listed as down in /workers
            self.answers.end_waits_on(w, f"stopped responding to heartbeats ({timeout:g} s)")
            self.metrics.worker_gone(w.worker_id, w.role)
            self._update_worker_gauges()
            fail_rooms_of(self.rooms, w, f"{w.role} worker {w.worker_id} stopped responding to heartbeats")

    def workers_changed(self) -> None:
        """A worker entered or left rotation outside the control plane (gateway/cluster/weights.py)."""
        self._update_worker_gauges()

    def _update_worker_gauges(self) -> None:
        for role in ("prefill", "decode"):
            self.metrics.workers.labels(role).set(len(self.registry.in_rotation(role)))
