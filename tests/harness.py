"""Real clusters for tests: `pdserve up`, or each role as its own process.

Every process runs in its own process group and is stopped by PID at teardown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

# Small pools and one thread per worker: several workers share the 2 cores of a CI machine.
WORKER_FLAGS = ["--max-total-tokens", "8192", "--num-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    url: str
    control_port: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    log_dir: str = ""

    def wait_healthy(self, timeout_s: float = 240.0, workers: int | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"a cluster process exited with {p.returncode}; logs in {self.log_dir}"
                    )
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and (workers is None or self.live_workers() >= workers):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster not healthy within {timeout_s} s; logs in {self.log_dir}")

    def live_workers(self) -> int:
        r = httpx.get(self.url + "/workers", timeout=5)
        return len(r.json().get("workers", []))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def spawn(argv: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    out = open(log_path, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", *argv],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def start_up(tmp_path, num_prefill: int = 1, num_decode: int = 1, extra: list[str] | None = None) -> Cluster:
    """`pdserve up` as one process (it starts and stops its own children)."""
    port = free_port()
    c = Cluster(f"http://127.0.0.1:{port}", free_port(), log_dir=str(tmp_path))
    argv = [
        "up",
        "--port",
        str(port),
        "--control-port",
        str(c.control_port),
        "--num-prefill",
        str(num_prefill),
        "--num-decode",
        str(num_decode),
        "--threads-per-worker",
        "1",
        "--max-total-tokens",
        "8192",
        "--log-dir",
        str(tmp_path),
        *(extra or []),
    ]
    c.procs.append(spawn(argv, os.path.join(tmp_path, "up.log")))
    return c


def start_roles(
    tmp_path,
    workers: list[tuple[str, dict] | tuple[str, dict, list[str]]],
    gateway_flags: list[str] | None = None,
) -> Cluster:
    """The gateway and each worker as separate processes; `workers` is [(role, extra env[, extra flags])].

    Worker i is named f"{role}-{i}"; extra flags come last, so they override the defaults.
    """
    port = free_port()
    c = Cluster(f"http://127.0.0.1:{port}", free_port(), log_dir=str(tmp_path))
    c.procs.append(
        spawn(
            ["gateway", "--port", str(port), "--control-port", str(c.control_port), *(gateway_flags or [])],
            os.path.join(tmp_path, "gateway.log"),
        )
    )
    for i, (role, env, *flags) in enumerate(workers):
        c.procs.append(start_worker(c, role, f"{role}-{i}", env, flags[0] if flags else None))
    return c


def start_worker(
    c: Cluster, role: str, worker_id: str, env: dict | None = None, flags: list[str] | None = None
) -> subprocess.Popen:
    """One worker of cluster `c` (not added to `c.procs`: the caller decides, e.g. for a restart)."""
    argv = [role, "--gateway", f"127.0.0.1:{c.control_port}", "--worker-id", worker_id, *WORKER_FLAGS]
    if role == "prefill":
        argv += ["--disaggregation-bootstrap-port", "0"]
    return spawn([*argv, *(flags or [])], os.path.join(c.log_dir, f"{worker_id}.log"), env)
