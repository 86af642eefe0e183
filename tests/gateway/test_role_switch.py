"""POST /workers/{id}/role against the real control plane (zmq sockets speaking the wire protocol): the
checks before a switch, its epochs, and what the gateway refuses during and after it. The switch of
real worker processes under load is tests/cluster/test_role_switch_cluster.py."""

from __future__ import annotations

import pytest

from pdserve.protocol import gateway as m

from .conftest import control_addr, gateway_client
from .test_control import Dealer, _register, _wait

ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture
def gw(tokenizer):
    with gateway_client(
        tokenizer, heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, admin_api_key="admin-key"
    ) as c:
        yield c


def _join(gw, worker_id: str, role: str, identity: str | None = None, epoch: int = 0) -> Dealer:
    d = Dealer(control_addr(gw), identity or worker_id)
    d.send(_register(worker_id, role=role).model_copy(update={"epoch": epoch}))
    ack = d.recv_kind(m.RegisterAck)
    assert ack.accepted, ack.reason
    return d


def _switch(gw, worker_id: str, role: str, headers=ADMIN):
    return gw.post(f"/workers/{worker_id}/role", json={"role": role}, headers=headers)


def _metric(gw, name: str) -> float:
    text = gw.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.timeout(60)
def test_a_switch_drains_flips_and_registers_under_a_new_epoch(gw):
    reg = gw.app.state.gw.registry
    p0, p1, d0 = _join(gw, "p0", "prefill"), _join(gw, "p1", "prefill"), _join(gw, "d0", "decode")
    dealers = [p0, p1, d0]
    try:
        # Checks before anything moves.
        assert _switch(gw, "p1", "decode", headers={}).status_code == 401  # an admin endpoint
        r = _switch(gw, "nobody", "decode")
        assert r.status_code == 404 and "nobody" in r.json()["error"]["message"]
        r = _switch(gw, "p1", "prefill")
        assert r.status_code == 409 and "prefill worker already" in r.json()["error"]["message"]
        r = _switch(gw, "d0", "prefill")
        assert r.status_code == 409 and "last decode worker" in r.json()["error"]["message"]
        assert _switch(gw, "p1", "sideways").status_code == 400

        r = _switch(gw, "p1", "decode")
        assert r.status_code == 202, r.text
        assert r.json() | {"since": 0} == {
            "worker_id": "p1",
            "state": "switching",
            "from": "prefill",
            "to": "decode",
            "epoch": 1,
            "since": 0,
        }
        order = p1.recv_kind(m.SwitchRole)
        assert (order.role, order.epoch) == ("decode", 1)
        assert [w.worker_id for w in reg.in_rotation("prefill")] == ["p0"]  # out of rotation at once
        listed = {w["worker_id"]: w for w in gw.get("/workers", headers=ADMIN).json()["workers"]}
        assert listed["p1"]["state"] == "switching" and listed["p1"]["switch"]["to"] == "decode"
        # One switch at a time, whichever worker.
        r = _switch(gw, "p0", "decode")
        assert r.status_code == 409 and "under way" in r.json()["error"]["message"]
        # A Register claiming the switch with the wrong role is refused.
        bad = Dealer(control_addr(gw), "p1/wrong")
        dealers.append(bad)
        bad.send(_register("p1", role="prefill").model_copy(update={"epoch": 1}))
        ack = bad.recv_kind(m.RegisterAck)
        assert not ack.accepted and "switch to decode" in ack.reason

        # The worker drained (Deregister) and comes back on a new connection, as decode, epoch 1: taken
        # at once although the old connection was alive a moment ago, and not counted as a restart.
        p1.send(m.Deregister(worker_id="p1"))
        p1_new = _join(gw, "p1", "decode", identity="p1/second", epoch=1)
        dealers.append(p1_new)
        w = reg.get("p1")
        assert (w.role, w.reg.epoch, w.restarts, w.draining) == ("decode", 1, 0, False)
        assert sorted(x.worker_id for x in reg.in_rotation("decode")) == ["d0", "p1"]
        assert _metric(gw, 'pdserve_role_switches_total{from_role="prefill",to_role="decode"}') == 1.0
        listed = {w["worker_id"]: w for w in gw.get("/workers", headers=ADMIN).json()["workers"]}
        assert (
            listed["p1"]["state"] == "healthy"
            and listed["p1"]["epoch"] == 1
            and listed["p1"]["switch"] is None
        )

        # The old connection's frames are the old role's: dropped and counted, never the new one's.
        p1.send(m.Pong(t0=0.0, t1=0.0, t2=0.0, queued=7))
        _wait(lambda: _metric(gw, "pdserve_stale_epoch_frames_total") == 1.0)
        assert reg.get("p1").queued == 0

        # Back to prefill (epoch 2); then a Register of epoch 1 is stale: refused, not retried.
        assert _switch(gw, "p1", "prefill").status_code == 202
        assert p1_new.recv_kind(m.SwitchRole).epoch == 2
        p1_third = _join(gw, "p1", "prefill", identity="p1/third", epoch=2)
        dealers.append(p1_third)
        stale = Dealer(control_addr(gw), "p1/stale")
        dealers.append(stale)
        stale.send(_register("p1", role="decode").model_copy(update={"epoch": 1}))
        ack = stale.recv_kind(m.RegisterAck)
        assert not ack.accepted and not ack.retry and "stale epoch 1" in ack.reason
        assert reg.get("p1").role == "prefill" and reg.get("p1").reg.epoch == 2
    finally:
        for d in dealers:
            d.close()


@pytest.mark.timeout(60)
def test_a_restart_in_the_launch_role_ends_a_switch_under_way(gw):
    """Killed mid-switch: the supervisor restarts it as launched (epoch 0), which the gateway takes as
    a restart; the switch is over, and another may begin."""
    reg = gw.app.state.gw.registry
    p0, p1, d0 = _join(gw, "p0", "prefill"), _join(gw, "p1", "prefill"), _join(gw, "d0", "decode")
    dealers = [p0, p1, d0]
    try:
        assert _switch(gw, "p1", "decode").status_code == 202
        p1.close()  # dies while draining
        dealers.remove(p1)
        # the id is held by a connection that stopped answering: the claim waits out one probe window
        back = Dealer(control_addr(gw), "p1/restarted")
        dealers.append(back)
        _wait(lambda: _retry_register(back, "p1", "prefill"), timeout_s=10)
        w = reg.get("p1")
        assert (w.role, w.reg.epoch, w.restarts, w.draining) == ("prefill", 0, 1, False)
        assert gw.app.state.gw.control.switches.pending == {}
        assert _switch(gw, "p0", "decode").status_code == 202
    finally:
        for d in dealers:
            d.close()


def _retry_register(d: Dealer, worker_id: str, role: str) -> bool:
    d.send(_register(worker_id, role=role))
    try:
        return d.recv_kind(m.RegisterAck, timeout_s=1.0).accepted
    except TimeoutError:
        return False
