#!/usr/bin/env python3
"""Start pdserve roles on this host: a gateway, P prefill and D decode workers, each pinned to a GPU.

    deploy/launch.sh --prefill-gpus 0,1 --decode-gpus 2,3            # one host, four GPUs
    deploy/launch.sh --device cpu --num-prefill 2 --num-decode 2     # the same topology on CPU
    deploy/launch.sh --no-gateway --gateway 10.0.0.1:30001 --host 10.0.0.2 --prefill-gpus 0,1
                                                                      # workers joining a remote gateway

Flags after `--` go verbatim to every worker (e.g. `-- --max-total-tokens 4096 --num-threads 1`).
Each child runs in its own process group with its own log file (`<log-dir>/<name>.log`); the
launcher prints `started <name> pid <pid> log <path>` for each. A child that crashes is restarted
with backoff (a crash-looping one every 30 s, never given up on); on SIGINT/SIGTERM it sends
SIGTERM to exactly those process groups (workers drain), waits `--stop-timeout`, then SIGKILLs
what is left. A worker that exits 0 on its own (drained by a SIGTERM sent to it
directly) is let go; the rest keep serving. Children die with the launcher, even when it is
SIGKILLed. The supervision is `pdserve.launch.supervisor`'s, shared with `pdserve up`: run this with an
interpreter that has pdserve installed (launch.sh takes it from $PYTHON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import urllib.request

from pdserve import env as pdserve_env
from pdserve.cluster_auth import add_secret_arg
from pdserve.config import GRAMMAR_COMPILE_TIMEOUT_S
from pdserve.launch.cpu_share import CPU_SHARING, cpu_share
from pdserve.launch.supervisor import Child, Supervisor, pdserve_command
from pdserve.launch.up import start_gateway


def _gpu_list(text: str | None) -> list[str]:
    return [g.strip() for g in (text or "").split(",") if g.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = pdserve_env.launch_default
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
    p.add_argument(
        "--port",
        type=int,
        default=int(env("PDSERVE_PORT", "30000") or 30000),
        help="gateway HTTP port (0: any free)",
    )
    p.add_argument(
        "--control-port", type=int, default=None, help="gateway control port (default port+1; 0: any free)"
    )
    p.add_argument(
        "--port-file",
        default=None,
        help='the gateway writes {"port": ..., "control_port": ...} here once bound (default: in --log-dir)',
    )
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
    p.add_argument(
        "--bootstrap-port-base", type=int, default=8998, help="prefill i listens on base+i (0: any free port)"
    )
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
    p.add_argument(
        "--cpu-sharing",
        default="turns",
        choices=list(CPU_SHARING),
        help="CPU workers sharing cores: turns or passive (see `pdserve up --help`)",
    )
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=GRAMMAR_COMPILE_TIMEOUT_S,
        help="seconds a constraint's grammar may take to compile, at the gateway and each worker (400 past it)",
    )
    p.add_argument("--log-dir", default=env("PDSERVE_LOG_DIR", "pdserve-logs"))
    p.add_argument("--log-level", default="info")
    add_secret_arg(p)
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
        args.control_port = 0 if args.port == 0 else args.port + 1
    if args.port_file is None:
        args.port_file = os.path.join(args.log_dir, "gateway.ports")
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


def plan(args: argparse.Namespace, control_port: int | None = None) -> list[Child]:
    """Every process to start, gateway first; local workers dial `control_port` (default: the flags')."""
    exe = pdserve_command(python=args.python)
    model = ["--model-path", args.model_path] if args.model_path else []
    # The path only: the secret itself never goes on a command line (env PDSERVE_CLUSTER_SECRET passes through).
    model += ["--cluster-secret-file", args.cluster_secret_file] if args.cluster_secret_file else []
    children = []
    if not args.no_gateway:
        gw = exe + ["gateway", "--host", args.gateway_host, "--port", str(args.port)]
        gw += ["--control-host", args.gateway_host, "--control-port", str(args.control_port)]
        gw += ["--port-file", args.port_file]
        gw += ["--grammar-compile-timeout", str(args.grammar_compile_timeout)]
        children.append(Child("gateway", gw + model + ["--log-level", args.log_level], {}))
    if args.gateway_only:
        return children
    gateway = args.gateway or f"127.0.0.1:{args.control_port if control_port is None else control_port}"
    n_workers = len(args.prefill_slots) + len(args.decode_slots)
    # Every core for each worker; when they share cores, their forwards take turns (as `pdserve up`;
    # pdserve/launch/cpu_share.py).
    lock = os.path.abspath(os.path.join(args.log_dir, "cpu-forward.lock"))
    cpu = cpu_share(args.threads_per_worker, n_workers, args.cpu_sharing, lock)
    common = [
        "--device",
        args.device,
        "--gateway",
        gateway,
        "--host",
        args.host,
        "--log-level",
        args.log_level,
        "--grammar-compile-timeout",
        str(args.grammar_compile_timeout),
    ]
    common += model
    if args.device == "cpu":
        common += cpu.flags(threads="--num-threads" not in args.worker_flags)
    k = 0
    for role, slots in (("prefill", args.prefill_slots), ("decode", args.decode_slots)):
        for i, gpu in enumerate(slots):
            name = f"{role}-{i}"
            argv = exe + [role, "--worker-id", args.worker_id_prefix + name] + common
            if role == "prefill":
                port = args.bootstrap_port_base + i if args.bootstrap_port_base else 0
                argv += ["--disaggregation-bootstrap-port", str(port)]
            if args.health_port_base:
                argv += ["--health-port", str(args.health_port_base + k)]
            k += 1
            # CPU workers see no GPU at all, so nothing is allocated there by accident.
            env = {"CUDA_VISIBLE_DEVICES": gpu if gpu is not None else ""}
            env.update(cpu.env(role) if args.device == "cpu" else {})
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


def run(args: argparse.Namespace) -> int:
    sup = Supervisor(args.log_dir, args.stop_timeout)
    sup.handle_signals()
    children = plan(args)
    worker_ids = [args.worker_id_prefix + c.name for c in children if c.name != "gateway"]
    try:
        port, workers = args.port, children
        if not args.no_gateway:
            try:
                port, control = start_gateway(sup, children[0], args.port_file)
            except (RuntimeError, TimeoutError) as e:
                sup.say(f"startup failed: the gateway did not start: {e}", error=True)
                return 1
            # Planned again with the control port the gateway got (they differ only for port 0).
            workers = plan(args, control_port=control)[1:]
        for c in workers:
            sup.start(c)
        url = args.gateway_url or (None if args.no_gateway else f"http://127.0.0.1:{port}")
        why = sup.wait_until(
            lambda: _ready(url, worker_ids, whole_cluster=not args.no_gateway), args.startup_timeout
        )
        if why:
            sup.say(f"startup failed: {why}; logs in {args.log_dir}", error=True)
            return 1
        sup.say(f"ready ({len(children)} processes, {url or f'gateway {args.gateway}'})")
        return sup.watch()
    finally:
        sup.stop()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
