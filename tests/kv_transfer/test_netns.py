"""KV transfer between two hosts: prefill and decode in two Linux network namespaces joined by a veth pair.

Needs root and `ip netns`; skipped otherwise. The namespaces (and with them the veth pair) are always
deleted, also when the test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

PAGE = 16
GEOM = ["--layers", "2", "--heads", "4", "--head-dim", "32", "--page-size", str(PAGE), "--pages", "1200"]
SUBNET = "10.231.{}.{}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_hosts(require_tool):
    """Two namespaces `prefill` and `decode` with a veth link; yields their names, addresses, interfaces."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    require_tool("ip", hint="from iproute2")
    tag = f"{os.getpid() % 100000}"
    ns_p, ns_d = f"pdkv_p{tag}", f"pdkv_d{tag}"
    if_p, if_d = f"kvp{tag}", f"kvd{tag}"  # interface names stay under 15 characters
    octet = os.getpid() % 250 + 1
    addr_p, addr_d = SUBNET.format(octet, 1), SUBNET.format(octet, 2)
    try:
        _ip("netns", "add", ns_p)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"ip netns unavailable: {exc.stderr.strip()}")
    try:
        _ip("netns", "add", ns_d)
        _ip("link", "add", if_p, "type", "veth", "peer", "name", if_d)
        _ip("link", "set", if_p, "netns", ns_p)
        _ip("link", "set", if_d, "netns", ns_d)
        for ns, ifname, addr in [(ns_p, if_p, addr_p), (ns_d, if_d, addr_d)]:
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {"ns": (ns_p, ns_d), "addr": (addr_p, addr_d), "if": (if_p, if_d)}
    finally:
        for ns in (ns_p, ns_d):
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes its end of the veth


@pytest.mark.netns
@pytest.mark.timeout(150)
def test_transfer_across_namespaces_then_link_down_fails_within_the_timeout(two_hosts, spawn, tmp_path):
    (ns_p, ns_d), (addr_p, _), (if_p, if_d) = two_hosts["ns"], two_hosts["addr"], two_hosts["if"]
    timeouts = ["--transfer-timeout", "3", "--waiting-timeout", "30"]
    prefill = spawn(
        "prefill", "--host", addr_p, "--seed", "1", *GEOM, *timeouts,
        prefix=["ip", "netns", "exec", ns_p], env={"GLOO_SOCKET_IFNAME": if_p},
    )  # fmt: skip
    decode = spawn(
        "decode", "--seed", "2", *GEOM, *timeouts,
        prefix=["ip", "netns", "exec", ns_d], env={"GLOO_SOCKET_IFNAME": if_d},
    )  # fmt: skip
    assert prefill.addr.startswith(addr_p)

    # A transfer across the link lands byte-exact.
    src, dst = [17, 4, 900, 33], [1000, 2, 64, 5]
    prefill.call("dump", path=str(tmp_path / "src.pt"))
    decode.call("dump", path=str(tmp_path / "before.pt"))
    decode.call("request", room="across", addr=prefill.addr, pages=dst, num_tokens=60)
    prefill.call("send", room="across", pages=src, num_tokens=60, metadata={"first_token": 3})
    got = decode.call("wait", rooms=["across"], timeout=60)["results"]["across"]
    assert got["state"] == "SUCCESS" and got["metadata"] == {"first_token": 3}, got
    decode.call("dump", path=str(tmp_path / "after.pt"))
    expected = torch.load(tmp_path / "before.pt")
    expected[dst] = torch.load(tmp_path / "src.pt")[src]
    assert torch.equal(torch.load(tmp_path / "after.pt"), expected)

    # A 38 MiB transfer, frozen mid-way (decode stopped), then the link goes down.
    pages = list(range(1200))
    decode.call("request", room="cut", addr=prefill.addr, pages=pages, num_tokens=1200 * PAGE)
    assert decode.call("wait_state", room="cut", state="WAITING_FOR_INPUT", timeout=30)["ok"]
    time.sleep(0.3)  # let the page list leave the decode node
    decode.signal(signal.SIGSTOP)
    prefill.call("send", room="cut", pages=pages, num_tokens=1200 * PAGE, metadata={"first_token": 0})
    assert prefill.call("wait_state", room="cut", state="TRANSFERRING", timeout=30)["ok"]
    time.sleep(0.3)
    _ip("-n", ns_d, "link", "set", if_d, "down")
    _ip("-n", ns_p, "link", "set", if_p, "down")
    cut_at = time.monotonic()
    decode.signal(signal.SIGCONT)
    sent = prefill.call("wait", rooms=["cut"], timeout=30)["results"]["cut"]
    got = decode.call("wait", rooms=["cut"], timeout=30)["results"]["cut"]
    elapsed = time.monotonic() - cut_at
    assert sent["state"] == "FAILED" and got["state"] == "FAILED", (sent, got)
    assert elapsed < 3 + 4, elapsed  # transfer_timeout_s, plus slack for a loaded machine; no hang
