#!/usr/bin/env python3
"""Start pdserve roles on this host: a gateway, P prefill and D decode workers, each pinned to a GPU.

    deploy/launch.sh --prefill-gpus 0,1 --decode-gpus 2,3            # one host, four GPUs
    deploy/launch.sh --device cpu --num-prefill 2 --num-decode 2     # the same topology on CPU
    deploy/launch.sh --no-gateway --gateway 10.0.0.1:30001 --host 10.0.0.2 --prefill-gpus 0,1
                                                                      # workers joining a remote gateway

Flags after `--` go verbatim to every worker (e.g. `-- --max-total-tokens 4096 --num-threads 1`).
Each child runs in its own process group with its own log file (`<log-dir>/<name>.log`); the
launcher prints `started <name> pid <pid> log <path>` for each. On SIGINT/SIGTERM, or when the
gateway or any worker fails, it sends SIGTERM to exactly those process groups (workers drain),
waits `--stop-timeout`, then SIGKILLs what is left. A worker that exits 0 on its own (drained by a
SIGTERM sent to it directly) is let go; the rest keep serving.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]  # added to this process's environment


def _gpu_list(text: str | None) -> list[str]:
    return [g.strip() for g in (text or "").split(",") if g.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ.get
    worker_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, worker_flags = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="launch.sh", description=__doc__.split("\n")[0])
    p.add_argument("--device", default=env("PDSERVE_DEVICE", "cuda"), help="cuda | cpu")
    p.add_argument(
        "--prefill-gpus", default=env("PDSERVE_PREFILL_GPUS"), help="e.g. 0,1: one prefill per GPU"
    )
    p.add_argument("--decode-gpus", default=env("PDSERVE_DECODE_GPUS"), help="e.g. 2,3: one decode per GPU")
    p.add_argument("--num-prefill", type=int, default=None, help="without GPU lists (CPU): how many")
    p.add_argument("--num-decode", type=int, default=None)
    p.add_argument("--model-path", default=env("PDSERVE_MODEL_PATH"))
    p.add_argument(
        "--no-gateway", action="store_true", help="start workers only; they join --gateway on another host"
    )
    p.add_argument(
        "--gateway-only", action="store_true", help="start the gateway only (the head of a multi-host setup)"
    )
    p.add_argument("--gateway-host", default="0.0.0.0", help="bind address of the gateway (HTTP and control)")
    p.add_argument("--port", type=int, default=int(env("PDSERVE_PORT", "30000")), help="gateway HTTP port")
    p.add_argument("--control-port", type=int, default=None, help="gateway control port (default port+1)")
    p.add_argument(
        "--gateway",
        default=env("PDSERVE_GATEWAY"),
        help="host:port of the gateway's control socket (default: the local one)",
    )
    p.add_argument(
        "--gateway-url",
        default=None,
        help="gateway HTTP URL to wait on (default: the local one; with --no-gateway: "
        "wait until this host's workers are listed on <url>/workers, or not at all if unset)",
    )
    p.add_argument(
        "--host",
        default=env("PDSERVE_HOST", "127.0.0.1"),
        help="address other hosts reach this host's workers at",
    )
    p.add_argument("--bootstrap-port-base", type=int, default=8998, help="prefill i listens on base+i")
    p.add_argument(
        "--health-port-base",
        type=int,
        default=0,
        help="worker k (prefill first, then decode) serves /livez, /readyz, /metrics on base+k (0: off)",
    )
    p.add_argument(
        "--worker-id-prefix",
        default=env("PDSERVE_WORKER_ID_PREFIX", socket.gethostname() + "-"),
        help="worker ids are <prefix>prefill-<i>; must differ between hosts",
    )
    p.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="CPU: torch threads per worker (default: every core)",
    )
    p.add_argument("--log-dir", default=env("PDSERVE_LOG_DIR", "pdserve-logs"))
    p.add_argument("--log-level", default="info")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for health")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds to let workers drain on stop")
    p.add_argument("--python", default=sys.executable, help="interpreter that has pdserve installed")
    args = p.parse_args(argv)
    args.worker_flags = worker_flags
    if args.no_gateway and args.gateway_only:
        p.error("--no-gateway and --gateway-only exclude each other")
    if args.no_gateway and not args.gateway:
        p.error("--no-gateway needs --gateway HOST:PORT (or env PDSERVE_GATEWAY)")
    if args.control_port is None:
        args.control_port = args.port + 1
    pg, dg = _gpu_list(args.prefill_gpus), _gpu_list(args.decode_gpus)
    if args.device == "cpu":
        args.prefill_slots = [None] * (args.num_prefill if args.num_prefill is not None else max(1, len(pg)))
        args.decode_slots = [None] * (args.num_decode if args.num_decode is not None else max(1, len(dg)))
    else:
        if args.num_prefill is not None or args.num_decode is not None:
            p.error("on GPUs, give --prefill-gpus/--decode-gpus instead of counts")
        args.prefill_slots, args.decode_slots = pg, dg
    if not args.gateway_only and not (args.prefill_slots or args.decode_slots):
        p.error("no workers to start: give --prefill-gpus/--decode-gpus (or --device cpu with counts)")
    if not args.no_gateway and not args.gateway_only and not (args.prefill_slots and args.decode_slots):
        p.error("a local cluster needs at least one prefill and one decode worker")
    return args


def plan(args: argparse.Namespace) -> list[Child]:
    """Every process to start, gateway first."""
    exe = [args.python, "-m", "pdserve.cli"]
    model = ["--model-path", args.model_path] if args.model_path else []
    children = []
    if not args.no_gateway:
        gw = exe + ["gateway", "--host", args.gateway_host, "--port", str(args.port)]
        gw += ["--control-host", args.gateway_host, "--control-port", str(args.control_port)]
        children.append(Child("gateway", gw + model + ["--log-level", args.log_level], {}))
    if args.gateway_only:
        return children
    gateway = args.gateway or f"127.0.0.1:{args.control_port}"
    n_workers = len(args.prefill_slots) + len(args.decode_slots)
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 2) // n_workers)
    # Workers sharing cores: idle OpenMP threads sleep instead of spinning (as `pdserve up` does).
    shared = args.device == "cpu" and n_workers * threads > (os.cpu_count() or 1)
    omp = {"OMP_WAIT_POLICY": "PASSIVE"} if shared and "OMP_WAIT_POLICY" not in os.environ else {}
    common = [
        "--device",
        args.device,
        "--gateway",
        gateway,
        "--host",
        args.host,
        "--log-level",
        args.log_level,
    ]
    common += model
    if args.device == "cpu" and "--num-threads" not in args.worker_flags:
        common += ["--num-threads", str(threads)]
    k = 0
    for role, slots in (("prefill", args.prefill_slots), ("decode", args.decode_slots)):
        for i, gpu in enumerate(slots):
            name = f"{role}-{i}"
            argv = exe + [role, "--worker-id", args.worker_id_prefix + name] + common
            if role == "prefill":
                argv += ["--disaggregation-bootstrap-port", str(args.bootstrap_port_base + i)]
            if args.health_port_base:
                argv += ["--health-port", str(args.health_port_base + k)]
            k += 1
            # CPU workers see no GPU at all, so nothing is allocated there by accident.
            env = {"CUDA_VISIBLE_DEVICES": gpu if gpu is not None else "", **omp}
            children.append(Child(name, argv + args.worker_flags, env))
    return children


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read() or b"{}") if r.status == 200 else None
    except (OSError, ValueError):
        return None


def _ready(url: str | None, worker_ids: list[str], whole_cluster: bool) -> bool:
    """Whether what this launcher started is serving.

    A whole cluster: the gateway's /health (>= 1 prefill and >= 1 decode) and every worker listed.
    Workers joining a remote gateway: every one of them listed there. A lone gateway: it answers.
    """
    if url is None:
        return True
    if not worker_ids:
        return _get_json(url + "/v1/models") is not None
    if whole_cluster:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status != 200:
                    return False
        except OSError:
            return False
    listed = _get_json(url + "/workers")
    if listed is None:
        return False
    live = {w["worker_id"] for w in listed.get("workers", []) if not w.get("draining")}
    return all(w in live for w in worker_ids)


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def run(self) -> int:
        args = self.args
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        os.makedirs(args.log_dir, exist_ok=True)
        url = args.gateway_url or (None if args.no_gateway else f"http://127.0.0.1:{args.port}")
        children = plan(args)
        worker_ids = [args.worker_id_prefix + c.name for c in children if c.name != "gateway"]
        try:
            for c in children:
                self._start(c)
            deadline = time.monotonic() + args.startup_timeout
            while not _ready(url, worker_ids, whole_cluster=not args.no_gateway):
                why = self._failed() or ("stopped" if self.stopping else None)
                if why is None and time.monotonic() > deadline:
                    why = f"not healthy within {args.startup_timeout:.0f} s"
                if why:
                    print(
                        f"launch: startup failed: {why}; logs in {args.log_dir}", file=sys.stderr, flush=True
                    )
                    return 1
                time.sleep(0.5)
            where = url or f"gateway {args.gateway}"
            print(f"launch: ready ({len(children)} processes, {where})", flush=True)
            while not self.stopping:
                why = self._failed()
                if why:
                    print(f"launch: {why}; stopping everything", file=sys.stderr, flush=True)
                    return 1
                time.sleep(0.5)
            return 0
        finally:
            self.stop()

    def _start(self, c: Child) -> None:
        path = os.path.join(self.args.log_dir, f"{c.name}.log")
        with open(path, "ab") as log:
            # A session of its own: signals reach the child only through the launcher, and the whole
            # process group (anything the child spawns) can be stopped at once.
            p = subprocess.Popen(
                c.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **c.env},
                start_new_session=True,
            )
        self.procs[c.name] = p
        print(f"launch: started {c.name} pid {p.pid} log {path}", flush=True)

    def _failed(self) -> str | None:
        """Why the cluster cannot go on, or None; forgets workers that drained and exited cleanly."""
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            if rc == 0 and name != "gateway":
                print(f"launch: {name} exited after draining", flush=True)
                del self.procs[name]
                continue
            return f"{name} exited with {rc}"
        return None

    def stop(self) -> None:
        """SIGTERM our process groups, workers before the gateway so they can finish and deregister."""
        order = sorted(self.procs.items(), key=lambda kv: kv[0] == "gateway")
        for name, p in order:
            if name == "gateway" and any(q.poll() is None for n, q in order if n != "gateway"):
                self._wait([q for n, q in order if n != "gateway"], self.args.stop_timeout)
            _signal_group(p, signal.SIGTERM)
        self._wait([p for _, p in order], self.args.stop_timeout)
        for _, p in order:
            _signal_group(p, signal.SIGKILL)  # whatever is left in each group, leader or not
            p.wait()

    @staticmethod
    def _wait(procs: list[subprocess.Popen], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    # The group id is the child's pid (its own session); it outlives the leader while members remain.
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    return Launcher(parse_args(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
