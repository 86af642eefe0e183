"""The pair groups' gloo listeners (kv_transfer/pair_group.py): a replaced group's listener closes with it,
and raw TCP connections to a live group's port cannot exhaust the worker's open files."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

PAGE = 16
BIG = ["--pages", "1200", "--page-size", str(PAGE), "--heads", "4", "--head-dim", "32", "--layers", "2"]


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (its own sockets, from /proc/PID/net/tcp*)."""
    inodes = _socket_inodes(pid)
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _transfer(prefill, decode, room: str) -> None:
    decode.call("request", room=room, addr=prefill.addr, pages=[5, 6], num_tokens=20)
    prefill.call("send", room=room, pages=[8, 9], num_tokens=20, metadata={"first_token": 0})
    assert decode.call("wait", rooms=[room], timeout=30)["results"][room]["state"] == "SUCCESS"
    assert prefill.call("wait", rooms=[room], timeout=30)["results"][room]["state"] == "SUCCESS"


@pytest.mark.timeout(120)
def test_a_replaced_groups_listener_is_closed(spawn):
    prefill = spawn("prefill", "--transfer-timeout", "2", *BIG)
    decode = spawn("decode", "--transfer-timeout", "2", *BIG)
    before = {p: listening_ports(p.pid) for p in (prefill, decode)}
    _transfer(prefill, decode, "first")  # gen 0
    gen0 = {p: listening_ports(p.pid) - before[p] for p in (prefill, decode)}
    assert all(gen0.values()), gen0
    # Stall gen 0 (SIGSTOP the decode mid-transfer): it times out and the next transfer builds gen 1.
    decode.call("request", room="stalled", addr=prefill.addr, pages=list(range(1200)), num_tokens=1200 * PAGE)
    assert decode.call("wait_state", room="stalled", state="WAITING_FOR_INPUT", timeout=30)["ok"]
    time.sleep(0.2)
    decode.signal(signal.SIGSTOP)
    prefill.call(
        "send", room="stalled", pages=list(range(1200)), num_tokens=1200 * PAGE, metadata={"first_token": 0}
    )
    result = prefill.call("wait", rooms=["stalled"], timeout=30)["results"]["stalled"]
    assert result["state"] == "FAILED", result
    decode.signal(signal.SIGCONT)
    assert decode.call("wait", rooms=["stalled"], timeout=30)["results"]["stalled"]["state"] == "FAILED"
    _transfer(prefill, decode, "second")  # gen 1
    for p in (prefill, decode):
        deadline = time.monotonic() + 10
        while listening_ports(p.pid) & gen0[p] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not listening_ports(p.pid) & gen0[p], f"gen 0's listener still open in {p.pid}"
        for port in gen0[p]:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert listening_ports(p.pid) - before[p], "no listener for gen 1"


def _group_port(pid: int, before: set[int]) -> int:
    new = listening_ports(pid) - before
    assert len(new) == 1, new
    return new.pop()


@pytest.mark.timeout(120)
def test_raw_connects_to_a_groups_port_are_shed_by_a_rebuild(spawn):
    """300 raw connects to each side's gloo port (gloo keeps every one open): the next transfers rebuild
    the group, and the files come back; the pair keeps working throughout."""
    prefill = spawn("prefill", *BIG)
    decode = spawn("decode", *BIG)
    before = {p: listening_ports(p.pid) for p in (prefill, decode)}
    _transfer(prefill, decode, "first")
    ports = {p: _group_port(p.pid, before[p]) for p in (prefill, decode)}
    files = {p: open_files(p.pid) for p in (prefill, decode)}
    raw = []
    for p in (prefill, decode):
        raw += [socket.create_connection(("127.0.0.1", ports[p]), timeout=5) for _ in range(300)]
    try:
        time.sleep(0.5)
        for p in (prefill, decode):
            assert open_files(p.pid) >= files[p] + 300  # what gloo keeps (today, for good)
        # Sender: rebuilt before this transfer; receiver: asks for a new group after it, built by the next.
        for room in ("second", "third"):
            _transfer(prefill, decode, room)
        time.sleep(0.5)
        for p in (prefill, decode):
            assert open_files(p.pid) < files[p] + 20, (p.pid, files[p], open_files(p.pid))
            assert ports[p] not in listening_ports(p.pid)
    finally:
        for s in raw:
            s.close()
    _transfer(prefill, decode, "fourth")


@pytest.mark.timeout(120)
def test_an_idle_pair_sheds_raw_connects(spawn):
    """The same 300 raw connects to each side with no transfer after them (a pair used only through
    shared memory never has one): the pair threads rebuild the group within a few of their periodic checks."""
    from pdserve.kv_transfer.pair_group import STRAY_CHECK_S

    prefill = spawn("prefill", *BIG)
    decode = spawn("decode", *BIG)
    before = {p: listening_ports(p.pid) for p in (prefill, decode)}
    _transfer(prefill, decode, "first")
    ports = {p: _group_port(p.pid, before[p]) for p in (prefill, decode)}
    files = {p: open_files(p.pid) for p in (prefill, decode)}
    raw = []
    for p in (prefill, decode):
        raw += [socket.create_connection(("127.0.0.1", ports[p]), timeout=5) for _ in range(300)]
    try:
        deadline = time.monotonic() + 4 * STRAY_CHECK_S + 10
        while time.monotonic() < deadline:
            if all(open_files(p.pid) < files[p] + 20 for p in (prefill, decode)):
                break
            time.sleep(0.5)
        for p in (prefill, decode):
            assert open_files(p.pid) < files[p] + 20, (p.pid, files[p], open_files(p.pid))
            assert ports[p] not in listening_ports(p.pid)
    finally:
        for s in raw:
            s.close()
    _transfer(prefill, decode, "second")  # the rebuilt group serves
