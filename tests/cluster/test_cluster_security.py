"""A local `pdserve up` as a neighbour on the same host would see it: every socket on 127.0.0.1,
the control and KV bootstrap ports closed to anyone without the cluster secret `pdserve up` made,
and the cluster serving on while strangers knock."""

from __future__ import annotations

import glob
import os
import socket
import time

import httpx
import pytest
import zmq

from pdserve.cluster_auth import ClusterKeys
from pdserve.protocol import gateway as gw
from pdserve.worker.link import WorkerLink

pytestmark = pytest.mark.timeout(300)

GENERATE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def _tree(root: int) -> list[int]:
    """`root` and every descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listening() -> dict[str, str]:
    """inode -> local address of every listening TCP socket on this host (IPv4 and IPv6)."""
    out = {}
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(path) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A":  # LISTEN
                    continue
                host_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(host_hex)
                if v6:  # four little-endian 32-bit words
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    host = socket.inet_ntop(socket.AF_INET6, raw)
                else:
                    host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                out[cols[9]] = f"{host}:{int(port_hex, 16)}"
    return out


def _loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def test_no_socket_of_a_local_cluster_listens_beyond_loopback(cluster):
    r = httpx.post(cluster.url + "/generate", json=GENERATE, timeout=120)  # pair groups come up
    assert r.status_code == 200, r.text
    pids = _tree(cluster.procs[0].pid)
    assert len(pids) >= 4  # pdserve up, the gateway, a prefill and a decode worker
    listening = _listening()
    ours = {i: listening[i] for p in pids for i in _socket_inodes(p) if i in listening}
    # HTTP, control, KV bootstrap at least (gloo's pair sockets and the health ports too, on 127.0.0.1).
    assert len(ours) >= 3, ours
    beyond = [a for a in ours.values() if not _loopback(a)]
    assert not beyond, f"listening beyond 127.0.0.1: {beyond}"
    # The launcher says what it opened.
    log = open(os.path.join(cluster.log_dir, "up.log")).read()
    assert "control" in log and "KV bootstrap" in log and "CurveZMQ" in log
    for name in ("gateway", "prefill-0", "decode-0"):
        assert "no cluster secret" not in open(os.path.join(cluster.log_dir, f"{name}.log")).read()


def _bootstrap_addr(cluster) -> str:
    workers = httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]
    return next(w["bootstrap_addr"] for w in workers if w.get("bootstrap_addr"))


def test_strangers_at_the_internal_ports_are_not_heard_and_the_cluster_serves_on(cluster):
    workers_before = sorted(w["worker_id"] for w in httpx.get(cluster.url + "/workers").json()["workers"])
    # A worker that does not hold the secret `pdserve up` made for its children.
    register = gw.Register(
        worker_id="decode-0",
        role="decode",
        fingerprint={},
        model_name="x",
        max_total_tokens=1 << 20,
        max_running_requests=1,
        context_length=1 << 20,
        vocab_size=1,
        t_send=time.time(),
    )
    for keys in (None, ClusterKeys.from_secret(b"not the secret of this cluster")):
        link = WorkerLink(f"127.0.0.1:{cluster.control_port}", lambda: register, time.time, keys=keys)
        link.start()
        try:
            with pytest.raises(TimeoutError):
                link.wait_registered(3)
            assert link.inbox.empty()
        finally:
            link.close()
    # The prefill's KV bootstrap port: a plain zmq peer and raw TCP bytes, cut-short handshakes.
    host, port = _bootstrap_addr(cluster).rsplit(":", 1)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{host}:{port}")
    for parts in (1, 3, 8):
        dealer.send_multipart([b"\x00garbage"] * parts)
    conns = [socket.create_connection((host, int(port)), timeout=2) for _ in range(10)]
    for i, c in enumerate(conns):
        c.sendall(os.urandom(200) if i % 2 else b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")
    time.sleep(1.0)
    assert not dealer.poll(200)
    for c in conns:
        c.close()
    dealer.close()
    ctx.term()
    # Nobody new joined, nobody was taken over or drained, and requests go through.
    workers = httpx.get(cluster.url + "/workers").json()["workers"]
    assert sorted(w["worker_id"] for w in workers) == workers_before
    assert all(w.get("state", "healthy") == "healthy" for w in workers), workers
    r = httpx.post(cluster.url + "/generate", json=GENERATE, timeout=120)
    assert r.status_code == 200 and r.json()["text"], r.text
