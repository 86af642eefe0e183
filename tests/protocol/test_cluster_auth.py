"""Who may speak on the internal zmq ports, over real sockets: the gateway's control plane and the
prefill's KV bootstrap port, with and without a cluster secret (pdserve/cluster_auth.py).

A stranger without the secret gets no frame through and hears nothing; a registered worker cannot
take another's id, deregister it, or answer for a room it was not given; the bootstrap port survives
garbage, multi-part, huge frames, half handshakes and fake pairs, and real transfers go on after."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time

import pytest
import zmq
from protocol.test_protocol import FAST, FP, _dealer, _pool, _recv, _register, _transfer

from pdserve.cluster_auth import ClusterKeys, ClusterSecretError, load_keys, secure_client
from pdserve.gateway.cluster.control import ControlPlane
from pdserve.gateway.cluster.rooms import TokensArrived
from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.kv_transfer import KVReceiver, KVSender
from pdserve.kv_transfer.mailbox import Close
from pdserve.protocol import gateway as gw
from pdserve.protocol import kv_control as kc
from pdserve.protocol.records import PrefillEvents
from pdserve.worker.link import WorkerLink

pytestmark = pytest.mark.timeout(90)

KEYS = ClusterKeys.from_secret(b"the cluster secret of this test run")
OTHER = ClusterKeys.from_secret(b"a secret someone guessed, wrongly")


def test_keys_derive_from_the_secret_alone(tmp_path, monkeypatch):
    again = ClusterKeys.from_secret(b"the cluster secret of this test run\n")  # a file's newline
    assert again == KEYS and KEYS != OTHER and KEYS.server != KEYS.client
    assert zmq.curve_public(KEYS.client.secret) == KEYS.client.public
    assert b"secret" not in repr(KEYS).encode() and KEYS.client.secret.decode() not in repr(KEYS)
    path = tmp_path / "secret"
    path.write_bytes(b"the cluster secret of this test run")
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    assert load_keys(str(path)) == KEYS and load_keys(None) is None
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "the cluster secret of this test run")
    assert load_keys(None) == KEYS
    with pytest.raises(ClusterSecretError, match="at least"):
        ClusterKeys.from_secret(b"short")


# ---- the gateway's control plane ----------------------------------------------------------------


class _Loop:
    """An event loop on a thread: the control plane runs there, as in the gateway."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn, *args):
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _plane(keys: ClusterKeys | None, heartbeat_timeout_s: float = 5.0):
    lp = _Loop()
    cfg = GatewayConfig(
        control_host="127.0.0.1",
        control_port=0,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    cp = ControlPlane(cfg, WorkerRegistry(), GatewayMetrics(), keys=keys)
    asyncio.run_coroutine_threadsafe(cp.start(), lp.loop).result(5)
    try:
        yield cp
    finally:
        asyncio.run_coroutine_threadsafe(cp.stop(), lp.loop).result(5)
        lp.close()


@pytest.fixture
def keyed_plane():
    yield from _plane(KEYS)


@pytest.fixture
def control_plane():
    yield from _plane(None)


def _link(port: int, worker_id: str, keys: ClusterKeys | None, role: str = "decode") -> WorkerLink:
    link = WorkerLink(f"127.0.0.1:{port}", lambda: _register(worker_id, role), time.time, keys=keys)
    link.start()
    return link


def test_a_peer_without_the_secret_cannot_register_and_hears_nothing(keyed_plane):
    port = keyed_plane.bound_port
    ctx = zmq.Context()
    plain = _dealer(ctx, f"tcp://127.0.0.1:{port}", b"d0")
    wrong = ctx.socket(zmq.DEALER)
    wrong.setsockopt(zmq.LINGER, 0)
    secure_client(wrong, OTHER, 1 << 20)
    wrong.connect(f"tcp://127.0.0.1:{port}")
    guessed = ctx.socket(zmq.DEALER)  # knows the server's public key, not the client's secret key
    guessed.setsockopt(zmq.LINGER, 0)
    secure_client(guessed, dataclasses.replace(KEYS, client=OTHER.client), 1 << 20)
    guessed.connect(f"tcp://127.0.0.1:{port}")
    strangers = [plain, wrong, guessed]
    try:
        for sock in strangers:
            sock.send(gw.encode(_register("d0")))
            sock.send(gw.encode(gw.Deregister(worker_id="d0")))
        time.sleep(1.0)
        assert keyed_plane.registry.all() == []
        for sock in strangers:
            assert not sock.poll(200), "a stranger heard from the gateway"
        # A link with the secret registers, and is pinged.
        link = _link(port, "d0", KEYS)
        try:
            link.wait_registered(5)
            assert keyed_plane.registry.get("d0").identity == link.identity
        finally:
            link.close()
        # Nor does a stranger's link ever get an answer.
        stranger = _link(port, "d1", OTHER)
        try:
            with pytest.raises(TimeoutError):
                stranger.wait_registered(2)
        finally:
            stranger.close()
    finally:
        for sock in strangers:
            sock.close()
        ctx.term()


def test_a_taken_id_is_refused_and_only_its_own_connection_deregisters_it(control_plane):
    port = control_plane.bound_port
    link = _link(port, "d0", None)
    ctx = zmq.Context()
    thief = _dealer(ctx, f"tcp://127.0.0.1:{port}", b"d0/thief")
    other = _dealer(ctx, f"tcp://127.0.0.1:{port}", b"d1")
    try:
        link.wait_registered(5)
        thief.send(gw.encode(_register("d0")))
        ack = _recv(thief, gw, gw.RegisterAck)
        assert not ack.accepted and ack.retry and "in use" in ack.reason
        w = control_plane.registry.get("d0")
        assert w.identity == link.identity and w.restarts == 0
        # The holder answered the probe that claim sent: a second claim, past the probe window, fails too.
        time.sleep(1.5)
        thief.send(gw.encode(_register("d0")))
        assert not _recv(thief, gw, gw.RegisterAck).accepted
        assert control_plane.registry.get("d0").identity == link.identity
        # A deregister under d0's name from anyone else: from an unregistered peer, from another worker.
        thief.send(gw.encode(gw.Deregister(worker_id="d0")))
        other.send(gw.encode(_register("d1")))
        assert _recv(other, gw, gw.RegisterAck).accepted
        other.send(gw.encode(gw.Deregister(worker_id="d0")))
        time.sleep(0.5)
        assert not control_plane.registry.get("d0").draining
        assert not control_plane.registry.get("d1").draining
        # Its own connection may.
        link.send(gw.Deregister(worker_id="d0"))
        deadline = time.monotonic() + 5
        while not control_plane.registry.get("d0").draining and time.monotonic() < deadline:
            time.sleep(0.02)
        assert control_plane.registry.get("d0").draining
    finally:
        link.close()
        thief.close()
        other.close()
        ctx.term()


def test_a_restarted_worker_gets_its_id_back_once_the_old_connection_is_lost():
    # A heartbeat timeout far longer than the test: the id comes back because the old connection does
    # not answer the probe the new one's claim sent, within about a second.
    for cp in _plane(None, heartbeat_timeout_s=60.0):
        first = _link(cp.bound_port, "d0", None)
        first.wait_registered(5)
        first.close()  # the process dies: no more pongs
        second = _link(cp.bound_port, "d0", None)  # its restart, a new connection
        try:
            t0 = time.monotonic()
            second.wait_registered(10)  # refused with retry until the old one missed the probe
            assert time.monotonic() - t0 < 5
            assert cp.registry.get("d0").identity == second.identity
            assert cp.registry.get("d0").restarts == 1
        finally:
            second.close()


def _registered(plane: ControlPlane, ctx: zmq.Context, worker_id: str, role: str) -> zmq.Socket:
    sock = _dealer(ctx, f"tcp://127.0.0.1:{plane.bound_port}", f"{worker_id}/x".encode())
    sock.send(gw.encode(_register(worker_id, role)))
    assert _recv(sock, gw, gw.RegisterAck).accepted
    return sock


def _on_loop(plane: ControlPlane, coro):
    """Run `coro` on the plane's event loop (rooms and the registry are the loop's to touch)."""
    return asyncio.run_coroutine_threadsafe(coro, plane._tasks[0].get_loop()).result(5)


def _open_room(plane: ControlPlane, room: str, prefill: str | None, decode: str):
    """Open a room as the gateway's request handler does; (room, registry)."""
    return _on_loop(plane, _open(plane, room, prefill, decode)), plane.registry


async def _open(plane: ControlPlane, room: str, prefill: str | None, decode: str):
    reg = plane.registry
    return plane.open_room(room, reg.get(prefill) if prefill else None, reg.get(decode), 8)


async def _drain_room(room) -> list:
    out = []
    while not room.inbox.empty():
        out.append(room.inbox.get_nowait())
    return out


def test_outputs_for_a_room_count_only_from_its_two_legs(control_plane):
    ctx = zmq.Context()
    p0 = _registered(control_plane, ctx, "p0", "prefill")
    d0 = _registered(control_plane, ctx, "d0", "decode")
    d1 = _registered(control_plane, ctx, "d1", "decode")
    try:
        room, _ = _open_room(control_plane, "r1", "p0", "d0")
        events = PrefillEvents(queue_entry=1.0, forward_entry=1.5, prefill_finished=2.0)
        stolen = gw.TokenBatch(
            worker_id="d1", outputs=[gw.TokenOutput(room="r1", token_ids=[666], finished=True)]
        )
        d1.send(gw.encode(stolen))
        d1.send(gw.encode(gw.RequestFailed(room="r1", role="decode", code="oom", message="lies")))
        d1.send(gw.encode(gw.PrefillDone(room="r1", events=events)))
        d0.send(gw.encode(gw.PrefillDone(room="r1", events=events)))  # the decode leg is no prefill
        p0.send(gw.encode(gw.RequestFailed(room="r1", role="decode", code="oom", message="not mine")))
        time.sleep(0.5)
        assert _on_loop(control_plane, _drain_room(room)) == [] and room.prefill_done is None
        # The legs themselves are heard.
        d0.send(gw.encode(gw.TokenBatch(worker_id="d0", outputs=[gw.TokenOutput(room="r1", token_ids=[7])])))
        p0.send(gw.encode(gw.PrefillDone(room="r1", events=events)))
        deadline = time.monotonic() + 5
        got: list = []
        while (not got or room.prefill_done is None) and time.monotonic() < deadline:
            got += _on_loop(control_plane, _drain_room(room))
            time.sleep(0.02)
        assert [type(e) for e in got] == [TokensArrived] and got[0].output.token_ids == [7]
        assert room.prefill_done is not None
    finally:
        for s in (p0, d0, d1):
            s.close()
        ctx.term()


def test_a_room_that_ends_aborts_its_unfinished_prefill_leg_and_reaches_lost_workers(control_plane):
    ctx = zmq.Context()
    p0 = _registered(control_plane, ctx, "p0", "prefill")
    d0 = _registered(control_plane, ctx, "d0", "decode")
    try:
        # The decode leg ended (finished, or failed on its own): no leg named, yet the prefill that
        # never reported PrefillDone is aborted, so its pages are freed.
        room, reg = _open_room(control_plane, "r1", "p0", "d0")
        _on_loop(control_plane, _close(control_plane, room, None, None))
        abort = _recv(p0, gw, gw.AbortRequest)
        assert abort.room == "r1" and abort.reason == "decode leg ended"
        assert reg.get("p0").inflight_requests == 0
        # A decode worker dropped by the heartbeat (alive, only slow) still hears its room's abort.
        room, reg = _open_room(control_plane, "r2", "p0", "d0")
        _on_loop(control_plane, _mark_down(control_plane, "d0"))
        _on_loop(control_plane, _close(control_plane, room, "cancelled", "cancelled"))
        assert _recv(d0, gw, gw.AbortRequest).room == "r2"
        assert _recv(p0, gw, gw.AbortRequest).room == "r2"
    finally:
        p0.close()
        d0.close()
        ctx.term()


async def _close(plane: ControlPlane, room, abort_decode, abort_prefill) -> None:
    plane.close_room(room, abort_decode=abort_decode, abort_prefill=abort_prefill)


async def _mark_down(plane: ControlPlane, worker_id: str) -> None:
    plane.registry.mark_down(worker_id, time.monotonic())


def test_the_control_port_drops_multipart_and_oversized_frames_and_keeps_serving(control_plane):
    ctx = zmq.Context()
    sock = _dealer(ctx, f"tcp://127.0.0.1:{control_plane.bound_port}", b"d0/a")
    try:
        sock.send_multipart([gw.encode(_register("d0")), b"tail"])  # a 2-part message: dropped
        sock.send_multipart([b"x"] * 20)
        assert not sock.poll(300)
        big = _dealer(ctx, f"tcp://127.0.0.1:{control_plane.bound_port}", b"big")
        big.send(b"x" * (17 << 20))  # over MAX_FRAME_BYTES: the connection is dropped, nothing buffered
        big.close()
        _half_handshakes(control_plane.bound_port)
        sock.send(gw.encode(_register("d0")))
        assert _recv(sock, gw, gw.RegisterAck).accepted
        assert all(not t.done() for t in control_plane._tasks)
    finally:
        sock.close()
        ctx.term()


def _half_handshakes(port: int, n: int = 20) -> None:
    """Raw TCP peers: random bytes, a ZMTP greeting cut short, a connection left open and silent."""
    conns = []
    for i in range(n):
        c = socket.create_connection(("127.0.0.1", port), timeout=2)
        c.sendall([os.urandom(64), b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03", b""][i % 3])
        conns.append(c)
    time.sleep(0.3)
    for c in conns:
        c.close()


# ---- the prefill's KV bootstrap port --------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture
def hardened():
    config = dataclasses.replace(
        FAST, bootstrap_timeout_s=2, max_pairs=4, max_early_lists=16, max_early_pages=1 << 16
    )
    s = KVSender(_pool(1), FP, "127.0.0.1", 0, config)
    s.start()
    r = KVReceiver(_pool(2), FP, config)
    r.start()
    yield s, r
    r.close()
    s.close()


def test_bootstrap_port_survives_garbage_big_frames_half_handshakes_and_fake_pairs(hardened):
    sender, receiver = hardened
    ctx = zmq.Context()
    addr = f"tcp://{sender.addr}"
    socks = []
    try:
        rss0 = _rss_mib()
        junk = _dealer(ctx, addr, b"junk")
        socks.append(junk)
        for parts in (2, 3, 10):
            junk.send_multipart([b"\x00" * 8] * parts)
        junk.send(b"{" * 100_000)  # deep nesting
        junk.send(
            b'{"v":4,"msg":{"kind":"page_list","room":"r","pages":[1],"num_tokens":' + b"9" * 5000 + b"}}"
        )
        big = _dealer(ctx, addr, b"big")
        big.send(b"x" * (5 << 20))  # over max_frame_bytes
        big.close()
        _half_handshakes(int(sender.addr.rsplit(":", 1)[1]))
        # Fake pairs that handshake (knowing the fingerprint), never join the pair group, and pile
        # up page lists for rooms that will never come: 600 lists of 40,000 pages (~850 MiB kept
        # without the caps).
        pages = list(range(100_000, 140_000))
        for i in range(8):
            fake = _dealer(ctx, addr, f"fake-{i}".encode())
            socks.append(fake)
            fake.send(kc.encode(kc.Hello(receiver_id=f"fake-{i}", identity=sender._identity)))
            assert _recv(fake, kc, kc.HelloAck).ok
            for j in range(75):
                fake.send(kc.encode(kc.PageList(room=f"bogus-{i}-{j}", pages=pages, num_tokens=640_000)))
        time.sleep(3.0)
        assert sender.io_failure() is None and sender._thread.is_alive()
        grown = _rss_mib() - rss0
        assert grown < 150, f"the sender kept {grown:.0f} MiB of bogus page lists"
        # The real decode node still pairs and transfers: a fake pair is evicted for it.
        receiver.connect(sender.addr)
        _transfer(sender, receiver, "after-fuzz")
        assert sender.io_failure() is None and receiver.io_failure() is None
    finally:
        for s in socks:
            s.close()
        ctx.term()


def test_the_decode_side_drops_multipart_frames_from_a_prefill_and_keeps_serving(sender, receiver):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    failures: list[BaseException] = []

    def connect() -> None:
        try:
            receiver.connect(f"127.0.0.1:{port}", timeout_s=8)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            failures.append(e)

    thread = threading.Thread(target=connect)
    thread.start()
    try:
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, kc.encode(kc.HelloAck(ok=False, error="x")), b"more"])
        router.send_multipart([identity, b"\x00" * 1000] + [b"y"] * 5)
        thread.join(10)
        assert failures and "no handshake reply" in str(failures[0])  # the multi-part refusal was dropped
    finally:
        thread.join(10)
        router.close()
        ctx.term()
    assert receiver.io_failure() is None
    receiver.connect(sender.addr)
    _transfer(sender, receiver, "after-multipart")


def test_with_keys_the_bootstrap_port_serves_only_holders_of_the_secret():
    keyed = dataclasses.replace(FAST, keys=KEYS, bootstrap_timeout_s=2)
    sender = KVSender(_pool(1), FP, "127.0.0.1", 0, keyed)
    sender.start()
    good, wrong, plain = (
        KVReceiver(_pool(2), FP, keyed),
        KVReceiver(_pool(3), FP, dataclasses.replace(keyed, keys=OTHER)),
        KVReceiver(_pool(4), FP, dataclasses.replace(keyed, keys=None)),
    )
    for r in (good, wrong, plain):
        r.start()
    try:
        for r in (wrong, plain):
            with pytest.raises(ConnectionError, match="no handshake reply"):
                r.connect(sender.addr)
        assert sender.handshake_errors() == []  # nothing of theirs reached the sender's code
        good.connect(sender.addr)
        _transfer(sender, good, "keyed")
    finally:
        for r in (good, wrong, plain):
            r.close()
        sender.close()


def test_a_dead_io_thread_is_reported():
    sender = KVSender(_pool(1), FP, "127.0.0.1", 0, FAST)
    sender.start()
    try:
        assert sender.io_failure() is None
        sender._mailbox.post(Close())  # forced: the thread ends while the worker still runs
        sender._thread.join(5)
        assert "KV transfer I/O thread stopped" in sender.io_failure()
    finally:
        sender.close()
    assert sender.io_failure() is None  # closed on purpose: nothing to report
