"""deploy/launch.sh on CPU: 2 prefill + 2 decode workers and a gateway as real processes.

One cluster for the module (startup costs ~30 s on two cores); the tests run in order:
health, a request through each decode worker, drain of a decode worker, then stop with nothing
left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.launch.supervisor import die_with
from pdserve.port_file import wait_port_file

REPO = Path(__file__).resolve().parents[2]


def wait_for(pred, timeout_s: float, what: str, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def workers(url: str, role: str | None = None) -> list[dict]:
    ws = httpx.get(url + "/workers", timeout=5).json()["workers"]
    return [w for w in ws if role is None or w["role"] == role]


def stream(url: str, prompt: str, n: int, on_chunk=None) -> dict:
    """Stream /generate; the last chunk (with meta_info) and how many chunks came."""
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    last, count = None, 0
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            last, count = json.loads(line[5:]), count + 1
            if on_chunk:
                on_chunk(count)
    assert last is not None
    return {"last": last, "chunks": count}


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.log_dir = tmp / "logs"
        self.out = open(tmp / "launch.out", "w+")
        cmd = [str(REPO / "deploy" / "launch.sh"), "--device", "cpu", "--num-prefill", "2"]
        # Port 0 everywhere: the gateway reports its ports in <log-dir>/gateway.ports.
        cmd += ["--num-decode", "2", "--port", "0", "--bootstrap-port-base", "0"]
        cmd += ["--log-dir", str(self.log_dir), "--worker-id-prefix", "t-", "--startup-timeout", "150"]
        cmd += ["--stop-timeout", "30", "--", "--max-total-tokens", "4096", "--num-threads", "1"]
        env = {**os.environ, "PYTHON": sys.executable}
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env, cwd=tmp, preexec_fn=die_with(os.getpid())
        )
        self.url = ""

    def output(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text()

    def pids(self) -> dict[str, int]:
        return {n: int(p) for n, p in re.findall(r"started (\S+) pid (\d+)", self.output())}

    def wait_ready(self) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited with {self.proc.returncode}:\n{self.output()}")
            return "launch: ready" in self.output()

        wait_for(ready, 160, "the cluster to become healthy", every_s=0.5)
        self.url = f"http://127.0.0.1:{wait_port_file(str(self.log_dir / 'gateway.ports'))['port']}"

    def kill(self) -> None:
        """Last resort after a failed test: nothing may outlive the module."""
        for pgid in [self.proc.pid, *self.pids().values()]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("launch"))
    try:
        c.wait_ready()
        yield c
    finally:
        if c.proc.poll() is None or any(group_alive(g) for g in c.pids().values()):
            c.kill()


@pytest.mark.timeout(200)
def test_all_roles_healthy(cluster):
    assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200
    ws = workers(cluster.url)
    assert sorted(w["worker_id"] for w in ws) == ["t-decode-0", "t-decode-1", "t-prefill-0", "t-prefill-1"]
    assert not any(w["draining"] for w in ws)
    # Each prefill worker has its own bootstrap port (base 0: each bound a free one).
    addrs = [w["bootstrap_addr"] for w in workers(cluster.url, "prefill")]
    assert len(set(addrs)) == 2 and all(a.startswith("127.0.0.1:") and int(a.split(":")[1]) for a in addrs)
    assert set(cluster.pids()) == {"gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"}
    for name in cluster.pids():
        assert (cluster.log_dir / f"{name}.log").exists()


def _routed_to_decode(url: str) -> dict[str, float]:
    """The gateway's count of request legs sent to each decode worker (/metrics)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pat = r'^pdserve_routed_requests_total\{role="decode",worker="([^"]+)"\} ([0-9.e+-]+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pat, text, re.M)}


def _watch_decode_load(url: str, stop: threading.Event, seen: dict[str, int]) -> None:
    while not stop.is_set():
        for w in workers(url, "decode"):
            seen[w["worker_id"]] = max(seen.get(w["worker_id"], 0), w["inflight_requests"])
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_requests_served_through_each_decode_worker(cluster):
    seen: dict[str, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_decode_load, args=(cluster.url, stop, seen))
    watcher.start()
    try:
        # Two at once: least-outstanding-work routing sends the second to the idle decode worker.
        with ThreadPoolExecutor(2) as pool:
            results = list(
                pool.map(lambda p: stream(cluster.url, p, 24), ["The capital of France is", "One, two,"])
            )
    finally:
        stop.set()
        watcher.join()
    for res in results:
        meta = res["last"]["meta_info"]
        assert meta["completion_tokens"] == 24 and meta["finish_reason"]["type"] == "length"
    assert seen == {"t-decode-0": 1, "t-decode-1": 1}, seen


@pytest.mark.timeout(150)
def test_sigterm_drains_a_decode_worker(cluster):
    chunks = [0]
    long_req = ThreadPoolExecutor(1)
    # Long enough to outlast the drain's observation on a fast CPU (64 tokens took 0.5 s on AVX-512).
    fut = long_req.submit(
        stream, cluster.url, "Write a long story about a dog.", 256, lambda n: chunks.__setitem__(0, n)
    )
    wait_for(lambda: chunks[0] >= 2, 60, "the long request to start streaming")
    busy = [w["worker_id"] for w in workers(cluster.url, "decode") if w["inflight_requests"]]
    assert len(busy) == 1, workers(cluster.url, "decode")
    victim = busy[0]
    other = ({"t-decode-0", "t-decode-1"} - {victim}).pop()
    pid = cluster.pids()[victim.removeprefix("t-")]
    os.kill(pid, signal.SIGTERM)
    wait_for(
        lambda: any(w["draining"] for w in workers(cluster.url, "decode") if w["worker_id"] == victim),
        10,
        "deregister",
    )
    assert not fut.done(), "the long request ended before the drain could be observed"

    # New requests, while the drained worker still streams, all go to the other worker.
    seen: dict[str, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_decode_load, args=(cluster.url, stop, seen))
    watcher.start()
    try:
        before = _routed_to_decode(cluster.url)
        with ThreadPoolExecutor(2) as pool:
            news = list(pool.map(lambda p: stream(cluster.url, p, 8), ["Hello there", "Good morning"]))
        after = _routed_to_decode(cluster.url)
    finally:
        stop.set()
        watcher.join()
    # Counted by the gateway, not sampled: 8-token requests can finish between two polls of the load.
    routed = {w: after.get(w, 0.0) - before.get(w, 0.0) for w in (victim, other)}
    assert routed == {victim: 0.0, other: 2.0}, routed
    assert seen[victim] == 1, seen  # the victim holds only the long request
    for res in news:
        assert res["last"]["meta_info"]["completion_tokens"] == 8

    res = fut.result(timeout=90)
    long_req.shutdown()
    meta = res["last"]["meta_info"]
    assert meta["completion_tokens"] == 256 and meta["finish_reason"]["type"] == "length"
    # Done draining: the worker exits on its own (0) and the launcher keeps the rest running.
    wait_for(lambda: not group_alive(pid), 30, "the drained worker to exit")
    wait_for(lambda: f"{victim.removeprefix('t-')} exited after draining" in cluster.output(), 5, "launcher")
    assert cluster.proc.poll() is None
    assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200


@pytest.mark.timeout(90)
def test_stop_leaves_no_process_behind(cluster):
    pids = cluster.pids()
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(timeout=60) == 0, cluster.output()
    # Every child led its own process group; none of them, nor anything they spawned, remains.
    alive = [name for name, pgid in pids.items() if group_alive(pgid)]
    assert alive == [], alive
    with pytest.raises(httpx.TransportError):
        httpx.get(cluster.url + "/health", timeout=2)
