"""How long a killed worker takes to serve again: `pdserve up` with two prefill and two decode workers,
each role's worker killed with SIGKILL in turn while a client keeps requests going; the launcher
restarts it. For each kill: seconds from the kill until the gateway lists the worker healthy again (it
registers only once its model is loaded and it can serve), the CPU seconds the new process spent
until then and the cores that makes on average, and the requests the client completed meanwhile
(the survivors serving; none may fail).

    pdserve bench restart [--kills 2] [--pdserve-args "--deterministic on"]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time

import httpx
import psutil

from pdserve.bench.launch_servers import launch, pdserve_up_argv, wait_healthy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench restart", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=2, help="kills per role")
    p.add_argument("--pdserve-args", default="", help="extra flags of the cluster")
    p.add_argument("--port", type=int, default=33500)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--restart-timeout", type=float, default=300.0)
    return p.parse_args(argv)


def started(log: str) -> dict[str, list[int]]:
    """`pdserve up` logs every child it starts: name -> pids, oldest first."""
    out: dict[str, list[int]] = {}
    with open(log) as f:
        for name, pid in re.findall(r"started (\S+) pid (\d+)", f.read()):
            out.setdefault(name, []).append(int(pid))
    return out


def workers(url: str) -> dict[str, dict]:
    listed = httpx.get(url + "/workers", params={"all": 1}, timeout=10).json()
    rows = listed["workers"] if isinstance(listed, dict) else listed
    return {w["worker_id"]: w for w in rows}


class Client(threading.Thread):
    """Short greedy requests one after another, counting completions and failures."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.ok, self.stop = url, 0, threading.Event()
        self.failures: dict[str, int] = {}  # status -> count

    def run(self) -> None:
        body = {"text": "Count from one to ten:", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                try:
                    r = c.post(self.url + "/generate", json=body)
                    status = str(r.status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.ok += status == "200"
                if status != "200":
                    self.failures[status] = self.failures.get(status, 0) + 1
                    time.sleep(0.2)


def kill_and_wait(url: str, log: str, name: str, timeout_s: float) -> tuple[float, float, int]:
    """(seconds until `name` is healthy again, CPU seconds of its new process until then, its pid)."""
    before = workers(url)[name]["restarts"]
    old = started(log)[name][-1]
    os.kill(old, signal.SIGKILL)
    t0 = time.monotonic()
    new_proc: psutil.Process | None = None
    cpu = 0.0
    while time.monotonic() - t0 < timeout_s:
        pids = started(log).get(name, [])
        if new_proc is None and pids and pids[-1] != old:
            new_proc = psutil.Process(pids[-1])
        if new_proc is not None:
            try:
                t = new_proc.cpu_times()
                cpu = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        w = workers(url).get(name)
        if w is not None and w["restarts"] > before and w["state"] == "healthy":
            return time.monotonic() - t0, cpu, pids[-1]
        time.sleep(0.1)
    raise RuntimeError(f"{name} was not back within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="pdserve-bench-restart-")
    flags = f"--num-prefill 2 --num-decode 2 {args.pdserve_args}"
    s = launch("pdserve", pdserve_up_argv(args.port, log_dir, flags), args.port, log_dir)
    try:
        wait_healthy(s, args.start_timeout)
        while sum(w["state"] == "healthy" for w in workers(s.url).values()) < 4:
            time.sleep(0.5)
        client = Client(s.url)
        client.start()
        time.sleep(3)
        up_log = s.log  # `pdserve up`'s own output: one line per child started
        print(f"{'worker':<10} {'kill -> healthy s':>18} {'CPU s':>7} {'cores':>6} {'served meanwhile':>17}")
        results: dict[str, list[float]] = {}
        for name in ("decode-0", "prefill-0") * args.kills:
            done0 = client.ok
            wall, cpu, _ = kill_and_wait(s.url, up_log, name, args.restart_timeout)
            results.setdefault(name, []).append(wall)
            served = client.ok - done0
            print(f"{name:<10} {wall:>18.2f} {cpu:>7.2f} {cpu / wall:>6.2f} {served:>17}", flush=True)
            time.sleep(2)
        client.stop.set()
        client.join(timeout=120)
        for name, walls in results.items():
            print(f"{name}: median {statistics.median(walls):.2f} s to serve again over {len(walls)} kills")
        print(f"client: {client.ok} requests completed, failed: {client.failures or 'none'}")
        return 0 if not client.failures else 1
    finally:
        os.killpg(s.proc.pid, signal.SIGTERM)
        s.proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
