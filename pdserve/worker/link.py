"""A worker's control link to the gateway: one DEALER socket owned by one I/O thread.

The I/O thread registers, answers pings at once with its own clock readings (so liveness and the
clock-offset estimate do not depend on how long a forward takes), and hands every other message
to the worker loop through a queue. The worker loop sends through `send`, which wakes the I/O
thread over an inproc socket; zmq sockets are never shared between threads.

The DEALER's zmq identity is `worker_id/<random>`, new for each process: the gateway knows this
worker by the connection that registered it, and no other process can speak under its name. With
cluster keys the socket runs CurveZMQ (pdserve/cluster_auth.py). A refusal marked `retry` (our id
is still held by the connection of a previous run of this worker) is retried every
`RETRY_REGISTER_S` instead of ending the worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdserve.cluster_auth import ClusterKeys, secure_client
from pdserve.protocol import gateway as m
from pdserve.protocol.codec import ProtocolError, VersionMismatch

log = logging.getLogger(__name__)

RETRY_REGISTER_S = 1.0
# The I/O thread's longest sleep: frames and send() wake it; only its slow timers (a registration retry,
# re-registering after silence) wait for this.
POLL_MS = 500
MAX_FRAME_BYTES = 16 << 20  # the gateway's frames: requests and acks, far below this


@dataclass
class LoadReport:
    """Written by the worker loop, read by the I/O thread for each Pong (plain ints: no lock needed)."""

    queued: int = 0
    running: int = 0
    free_tokens: int = 0
    draining: bool = False


class RegistrationRefused(RuntimeError):
    pass


class WorkerLink:
    def __init__(
        self,
        gateway_addr: str,
        register: Callable[[], m.Register],
        clock: Callable[[], float],
        reregister_after_s: float = 10.0,
        keys: ClusterKeys | None = None,
    ):
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._register = register
        self.clock = clock
        self.worker_id = register().worker_id
        self.identity = f"{self.worker_id}/{uuid.uuid4().hex}".encode()
        self._keys = keys
        self._retry_at: float | None = None  # when to register again after a `retry` refusal
        self.gateway_addr = gateway_addr if "://" in gateway_addr else f"tcp://{gateway_addr}"
        self.load = LoadReport()
        self.inbox: queue.Queue[m.Message | None] = queue.Queue()  # None: wake() (no message)
        self._outbox: queue.Queue[bytes] = queue.Queue()
        self._wake_addr = f"inproc://wake-{uuid.uuid4().hex}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_local = threading.local()
        self._stop = threading.Event()
        self.registered = threading.Event()
        # Accepted registrations so far (written by the I/O thread only): a worker that owes the
        # gateway a fresh view of its state after each one (the prefix cache snapshot) watches it.
        self.accepted = 0
        self.refused: str | None = None
        self._reregister_after_s = reregister_after_s
        self._thread = threading.Thread(target=self._run, name="worker-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_registered(self, timeout_s: float, cancel: threading.Event | None = None) -> None:
        """Block until the gateway accepts us; `cancel` (a drain signal) gives up early."""
        deadline = time.monotonic() + timeout_s
        while not self.registered.is_set():
            if self.refused:
                raise RegistrationRefused(self.refused)
            if cancel is not None and cancel.is_set():
                raise TimeoutError("stopped before the gateway answered")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no answer from the gateway at {self.gateway_addr} within {timeout_s:.0f} s"
                )
            self.registered.wait(0.05)
        if self.refused:
            raise RegistrationRefused(self.refused)

    def send(self, msg: m.Message) -> None:
        self._outbox.put(m.encode(msg))
        self._poke()

    def _poke(self) -> None:
        """Wake the I/O thread (from any thread: each has its own PUSH socket)."""
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self._wake_local.sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self._wake_addr)
        sock.send(b"", zmq.NOBLOCK)

    def wake(self) -> None:
        """End the worker loop's current recv() wait now (another thread has news for it)."""
        self.inbox.put(None)

    def recv(self, timeout_s: float) -> list[m.Message]:
        """Messages for the worker loop; waits up to timeout_s for the first one, or for a wake()."""
        got = []
        try:
            got.append(self.inbox.get(timeout=timeout_s) if timeout_s > 0 else self.inbox.get_nowait())
        except queue.Empty:
            return []
        while True:
            try:
                got.append(self.inbox.get_nowait())
            except queue.Empty:
                return [msg for msg in got if msg is not None]

    def close(self) -> None:
        self._stop.set()
        self._poke()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.identity)
        dealer.setsockopt(zmq.LINGER, 500)
        secure_client(dealer, self._keys, MAX_FRAME_BYTES)
        dealer.connect(self.gateway_addr)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        dealer.send(m.encode(self._register()))
        last_heard = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                if self._wake_pull in events:
                    while self._wake_pull.poll(0):
                        self._wake_pull.recv()
                while True:
                    try:
                        dealer.send(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                if dealer in events:
                    while dealer.poll(0):
                        frame = dealer.recv()
                        last_heard = time.monotonic()
                        self._on_frame(dealer, frame)
                if self._retry_at is not None and time.monotonic() >= self._retry_at:
                    self._retry_at = None
                    dealer.send(m.encode(self._register()))
                if time.monotonic() - last_heard > self._reregister_after_s:
                    # The gateway restarted or lost us: introduce ourselves again.
                    dealer.send(m.encode(self._register()))
                    last_heard = time.monotonic()
        finally:
            dealer.close(linger=500)

    def _on_frame(self, dealer: zmq.Socket[bytes], frame: bytes) -> None:
        try:
            msg = m.decode(frame)
        except ProtocolError as e:  # a bad frame must never kill the link
            log.warning("dropping a control frame: %s", e)
            if isinstance(e, VersionMismatch) and not self.registered.is_set():
                # A gateway of another release answering our Register: we cannot work with it.
                self.refused = f"the gateway at {self.gateway_addr} speaks another protocol: {e}"
            return
        if isinstance(msg, m.Ping):
            t1 = self.clock()
            ld = self.load
            dealer.send(
                m.encode(
                    m.Pong(
                        t0=msg.t0,
                        t1=t1,
                        t2=self.clock(),
                        queued=ld.queued,
                        running=ld.running,
                        free_tokens=ld.free_tokens,
                        draining=ld.draining,
                    )
                )
            )
        elif isinstance(msg, m.RegisterAck):
            if msg.accepted:
                self.accepted += 1
                self.registered.set()
            elif msg.retry:
                log.warning("registration refused for now (%s): retrying", msg.reason)
                self._retry_at = time.monotonic() + RETRY_REGISTER_S
            else:
                self.refused = msg.reason or "refused by the gateway"
                log.error("registration refused: %s", self.refused)
        else:
            self.inbox.put(msg)
