"""Real clusters for tests: `pdserve up`, or each role as its own process.

Every process runs in its own process group, dies with the test run (pdserve.launch.up.spawn) and is
stopped by PID at teardown. Nothing uses a fixed port: the gateway binds port 0 and reports what it
got in a port file; workers dial that.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field

import httpx

from pdserve.launch.supervisor import pdserve_command, signal_group
from pdserve.launch.supervisor import spawn as spawn_process
from pdserve.port_file import wait_port_file

# Small pools and one thread per worker: several workers share the 2 cores of a CI machine.
# float32: the exactness reference (the tests compare with transformers and with the offline engine).
WORKER_FLAGS = ["--max-total-tokens", "8192", "--num-threads", "1", "--dtype", "float32"]


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
        stop_processes(self.procs)


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left after the grace."""
    for p in procs:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        signal_group(p, signal.SIGKILL)  # the leader if it is still there, and anything left in its group
        p.wait()


def process_alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def spawn(argv: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    """`pdserve <argv>` in its own process group, dying with the test run."""
    return spawn_process(pdserve_command(*argv), log_path, env)


def start_gateway(
    log_dir, flags: list[str] | None = None, env: dict | None = None
) -> tuple[subprocess.Popen, int, int]:
    """`pdserve gateway` on any free ports: (process, HTTP port, control port) once both are bound."""
    port_file = os.path.join(log_dir, "gateway.ports")
    argv = ["gateway", "--host", "127.0.0.1", "--port", "0", "--control-host", "127.0.0.1"]
    argv += ["--control-port", "0", "--port-file", port_file, *(flags or [])]
    p = spawn(argv, os.path.join(log_dir, "gateway.log"), env)
    try:
        ports = wait_port_file(port_file, p, timeout_s=120)
    except BaseException:
        stop_processes([p])
        raise
    return p, ports["port"], ports["control_port"]


def start_up(
    tmp_path,
    num_prefill: int = 1,
    num_decode: int = 1,
    extra: list[str] | None = None,
    env: dict | None = None,
) -> Cluster:
    """`pdserve up` as one process (it starts and stops its own children), on any free ports; `env`
    adds to the environment (API keys, say)."""
    port_file = os.path.join(tmp_path, "gateway.ports")
    argv = [
        "up",
        "--port",
        "0",
        "--port-file",
        port_file,
        "--num-prefill",
        str(num_prefill),
        "--num-decode",
        str(num_decode),
        "--threads-per-worker",
        "1",
        "--max-total-tokens",
        "8192",
        "--dtype",
        "float32",
        "--log-dir",
        str(tmp_path),
        *(extra or []),
    ]
    p = spawn(argv, os.path.join(tmp_path, "up.log"), env)
    try:
        ports = wait_port_file(port_file, p, timeout_s=120)
    except BaseException:
        stop_processes([p])
        raise
    return Cluster(f"http://127.0.0.1:{ports['port']}", ports["control_port"], [p], log_dir=str(tmp_path))


def start_roles(
    tmp_path,
    workers: list[tuple[str, dict] | tuple[str, dict, list[str]]],
    gateway_flags: list[str] | None = None,
) -> Cluster:
    """The gateway and each worker as separate processes; `workers` is [(role, extra env[, extra flags])].

    Worker i is named f"{role}-{i}"; extra flags come last, so they override the defaults.
    """
    gateway, port, control_port = start_gateway(str(tmp_path), gateway_flags)
    c = Cluster(f"http://127.0.0.1:{port}", control_port, [gateway], log_dir=str(tmp_path))
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


def started_pids(log_dir: str) -> dict[str, list[int]]:
    """`pdserve up` reports every child it starts in <log_dir>/up.log: name -> pids, oldest first."""
    out: dict[str, list[int]] = {}
    with open(os.path.join(log_dir, "up.log")) as f:
        for name, pid in re.findall(r"started (\S+) pid (\d+)", f.read()):
            out.setdefault(name, []).append(int(pid))
    return out
