"""The control plane over real zmq sockets: registration, heartbeats, clocks, liveness, draining."""

from __future__ import annotations

import time

import pytest
import zmq

from pdserve.protocol import gateway as m

from .conftest import FINGERPRINT, control_addr, gateway_client


def _register(worker_id: str, role: str = "decode", skew: float = 0.0, **fp) -> m.Register:
    return m.Register(
        worker_id=worker_id,
        role=role,
        bootstrap_addr="127.0.0.1:7000" if role == "prefill" else None,
        fingerprint={**FINGERPRINT, **fp},
        model_name="smollm2",
        max_total_tokens=4096,
        max_running_requests=8,
        context_length=2048,
        vocab_size=49152,
        t_send=time.time() + skew,
    )


class Dealer:
    """A bare DEALER socket with worker_id as its identity: the worker side of the wire."""

    def __init__(self, addr: str, worker_id: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, msg) -> None:
        self.sock.send(m.encode(msg))

    def recv(self, timeout_s: float = 3.0):
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("nothing from the gateway")
        return m.decode(self.sock.recv())

    def recv_kind(self, kind: type, timeout_s: float = 3.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.recv(deadline - time.monotonic())
            if isinstance(msg, kind):
                return msg
        raise TimeoutError(f"no {kind.__name__}")

    def pong(self, ping: m.Ping, skew: float = 0.0, **load) -> None:
        t1 = time.time() + skew
        self.send(m.Pong(t0=ping.t0, t1=t1, t2=time.time() + skew, **load))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _wait(cond, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


@pytest.fixture
def gw(tokenizer):
    with gateway_client(tokenizer, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.6) as c:
        yield c


@pytest.mark.timeout(30)
def test_register_ping_pong_then_silence_removes(gw):
    reg = gw.app.state.gw.registry
    d = Dealer(control_addr(gw), "d0")
    p = Dealer(control_addr(gw), "p0")
    try:
        d.send(_register("d0", skew=5.0))
        assert d.recv_kind(m.RegisterAck).accepted
        p.send(_register("p0", role="prefill"))
        assert p.recv_kind(m.RegisterAck).accepted
        # Pings come every heartbeat interval; the decode answers with a clock 5 s ahead.
        for _ in range(5):
            d.pong(d.recv_kind(m.Ping), skew=5.0, queued=2, running=3, free_tokens=1000)
            p.pong(p.recv_kind(m.Ping))
        w = reg.get("d0")
        assert w.queued == 2 and w.running == 3 and w.free_tokens == 1000
        assert w.clock.offset == pytest.approx(5.0, abs=0.05)
        assert w.clock.best().rtt < 1.0
        assert gw.get("/health").status_code == 200
        metrics = gw.get("/metrics").text
        assert 'pdserve_worker_running_requests{role="decode",worker="d0"} 3.0' in metrics
        # The decode goes silent; the prefill keeps answering.
        t_silent = time.monotonic()
        deadline = time.monotonic() + 3.0
        while reg.get("d0") is not None and time.monotonic() < deadline:
            try:
                p.pong(p.recv_kind(m.Ping, 0.5))
            except TimeoutError:
                pass
        assert reg.get("d0") is None
        # Removed within the timeout, plus at most one heartbeat interval and scheduling slack.
        assert time.monotonic() - t_silent < 0.6 + 0.05 + 0.5
        assert reg.get("p0") is not None
        assert gw.get("/health").status_code == 503
    finally:
        d.close()
        p.close()


@pytest.mark.timeout(30)
def test_fingerprint_mismatch_refused_with_field_named_but_no_value(gw):
    a, b = Dealer(control_addr(gw), "d0"), Dealer(control_addr(gw), "d1")
    try:
        a.send(_register("d0"))
        assert a.recv_kind(m.RegisterAck).accepted
        b.send(_register("d1", page_size=32, dtype="float32"))
        ack = b.recv_kind(m.RegisterAck)
        assert not ack.accepted and not ack.retry
        assert "page_size" in ack.reason and "dtype" in ack.reason
        # The expected values stay private: a stranger learns what differs, not what to send.
        assert "16" not in ack.reason and "bfloat16" not in ack.reason and "d0" not in ack.reason
        assert gw.app.state.gw.registry.get("d1") is None
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_prefill_without_bootstrap_refused(gw):
    d = Dealer(control_addr(gw), "p9")
    try:
        reg = _register("p9", role="prefill").model_copy(update={"bootstrap_addr": None})
        d.send(reg)
        ack = d.recv_kind(m.RegisterAck)
        assert not ack.accepted and "bootstrap_addr" in ack.reason
    finally:
        d.close()


@pytest.mark.timeout(30)
def test_garbage_frames_do_not_stop_the_loop(gw):
    d = Dealer(control_addr(gw), "d0")
    try:
        d.sock.send(b"not json")
        d.sock.send(b'{"v": 99, "msg": {"kind": "ping", "t0": 1.0}}')
        d.sock.send(b'{"v": 1, "msg": {"kind": "martian"}}')
        d.sock.send_multipart([b"two", b"frames"])
        d.send(m.Pong(t0=0.0, t1=0.0, t2=0.0))  # before registering: dropped
        d.send(_register("d0"))
        assert d.recv_kind(m.RegisterAck).accepted
    finally:
        d.close()


@pytest.mark.timeout(30)
def test_deregister_leaves_rotation_but_stays_known(gw):
    reg = gw.app.state.gw.registry
    d, p = Dealer(control_addr(gw), "d0"), Dealer(control_addr(gw), "p0")
    try:
        d.send(_register("d0"))
        p.send(_register("p0", role="prefill"))
        assert d.recv_kind(m.RegisterAck).accepted and p.recv_kind(m.RegisterAck).accepted
        assert gw.get("/health").status_code == 200
        d.send(m.Deregister(worker_id="d0"))
        _wait(lambda: reg.get("d0").draining)
        assert reg.in_rotation("decode") == []
        # Still pinged: it keeps serving what it holds.
        d.pong(d.recv_kind(m.Ping))
        assert gw.get("/health").status_code == 503
        r = gw.post("/generate", json={"text": "hi"})
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
    finally:
        d.close()
        p.close()
