"""The multi-host recipe of deploy/README.md, with Linux network namespaces standing in for hosts.

Four namespaces (gateway, prefill, decode, client), each with one veth (`pd0`) onto a bridge in a
fifth (the switch); the roles are started with deploy/launch.sh exactly as the recipe says, and the
client reaches the gateway only over the bridge. Needs root and `ip netns`; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.launch.supervisor import die_with

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.213.7"  # only ever inside the namespaces made here
HOSTS = {"gw": 1, "prefill": 2, "decode": 3, "client": 4}
IFNAME = "pd0"

pytestmark = pytest.mark.netns


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Namespaces:
    """The namespaces and veths of one test; `close` removes every one it made."""

    def __init__(self) -> None:
        tag = f"pdt{os.getpid() % 100000}"
        self.switch = f"{tag}-sw"
        self.ns = {h: f"{tag}-{h}" for h in HOSTS}
        self.made: list[str] = []

    def build(self) -> None:
        for name in [self.switch, *self.ns.values()]:
            ip("netns", "add", name)
            self.made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host, n in HOSTS.items():
            ns, peer = self.ns[host], f"sw-{host}"
            # Made in the switch, then one end moved into the host namespace.
            ip("-n", self.switch, "link", "add", IFNAME, "type", "veth", "peer", "name", peer)
            ip("-n", self.switch, "link", "set", IFNAME, "netns", ns)
            ip("-n", self.switch, "link", "set", peer, "master", "br0")
            ip("-n", self.switch, "link", "set", peer, "up")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", IFNAME)
            ip("-n", ns, "link", "set", IFNAME, "up")

    def close(self) -> None:
        for name in reversed(self.made):
            ip("netns", "del", name, check=False)  # takes its veths (and their peers) along


def addr(host: str) -> str:
    return f"{SUBNET}.{HOSTS[host]}"


@pytest.fixture
def hosts(require_tool):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    require_tool("ip", hint="from iproute2")
    nets = Namespaces()
    try:
        try:
            nets.build()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot build network namespaces here: {e.stderr.strip()}")
        yield nets
    finally:
        nets.close()


class Role:
    """deploy/launch.sh run inside a namespace (`ip netns exec` execs it: same pid)."""

    def __init__(self, nets: Namespaces, host: str, flags: list[str], tmp: Path) -> None:
        self.host, self.out = host, tmp / f"{host}.out"
        env = {**os.environ, "PYTHON": sys.executable, "GLOO_SOCKET_IFNAME": IFNAME}
        cmd = ["ip", "netns", "exec", nets.ns[host], str(REPO / "deploy" / "launch.sh")]
        cmd += ["--log-dir", str(tmp / f"{host}-logs"), "--log-level", "warning"] + flags
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with(os.getpid()),
            )

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{self.host} launcher exited {self.proc.returncode}:\n{self.out.read_text()}"
            )
        return "launch: ready" in self.out.read_text()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return -9

    def kill_all(self) -> None:
        """After a failure: every process group this launcher reported, then the launcher."""
        import re

        for pid in re.findall(r"started \S+ pid (\d+)", self.out.read_text()):
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


CLIENT = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
import httpx
url = sys.argv[1]
def gen(prompt):
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=120).json()
with ThreadPoolExecutor(2) as pool:
    outs = list(pool.map(gen, ["The capital of France is", "Hello"]))
print(json.dumps({"outs": outs, "workers": httpx.get(url + "/workers", timeout=5).json()["workers"]}))
"""


@pytest.mark.timeout(200)
def test_roles_on_separate_hosts_serve_requests(hosts, tmp_path):
    gw = f"{addr('gw')}:30001"
    small = ["--", "--max-total-tokens", "4096", "--num-threads", "1"]
    join = ["--no-gateway", "--gateway", gw, "--gateway-url", f"http://{addr('gw')}:30000", "--device", "cpu"]
    roles = [Role(hosts, "gw", ["--gateway-only"], tmp_path)]
    try:
        roles.append(
            Role(
                hosts,
                "prefill",
                join + ["--host", addr("prefill"), "--num-prefill", "1", "--num-decode", "0"] + small,
                tmp_path,
            )
        )
        roles.append(
            Role(
                hosts,
                "decode",
                join + ["--host", addr("decode"), "--num-prefill", "0", "--num-decode", "1"] + small,
                tmp_path,
            )
        )
        deadline = time.monotonic() + 150
        while not all(r.ready() for r in roles):
            assert time.monotonic() < deadline, "the roles did not become ready"
            time.sleep(0.5)

        res = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                hosts.ns["client"],
                sys.executable,
                "-c",
                CLIENT,
                f"http://{addr('gw')}:30000",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        for out in got["outs"]:
            assert out["meta_info"]["completion_tokens"] == 8, out
        by_role = {w["role"]: w for w in got["workers"]}
        # The prefill node advertises its namespace's address; the decode node pulled KV from there.
        assert by_role["prefill"]["bootstrap_addr"] == f"{addr('prefill')}:8998"
        assert {w["role"] for w in got["workers"]} == {"prefill", "decode"}

        # The worker hosts stop first (they drain and deregister), then the gateway.
        assert [r.stop() for r in reversed(roles)] == [0, 0, 0]
    finally:
        for r in roles:
            r.kill_all()
