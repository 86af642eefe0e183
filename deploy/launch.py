#!/usr/bin/env python3
"""Start pdserve roles on this host: a gateway, P prefill and D decode workers, each pinned to a GPU.

    deploy/launch.sh --prefill-gpus 0,1 --decode-gpus 2,3            # one host, four GPUs
    deploy/launch.sh --prefill-gpus 0,1,2,3 --decode-gpus 4,5,6,7 --prefill-tp 2 --decode-tp 4
                                                                      # 2 prefill workers of TP 2, 1 decode of TP 4
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
import sys
import urllib.request

from pdserve.launch.cpu_share import cpu_share
from pdserve.launch.flag import GATEWAY_CHILD, LAUNCH, WORKER_CHILD
from pdserve.launch.flags import add_flags, passed_on
from pdserve.launch.supervisor import Child, Supervisor, pdserve_command
from pdserve.launch.up import start_gateway


def _gpu_list(text: str | None) -> list[str]:
    return [g.strip() for g in (text or "").split(",") if g.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    worker_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, worker_flags = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="launch.sh", description=__doc__.split("\n")[0])
    add_flags(p, LAUNCH)
    args = p.parse_args(argv)
    args.worker_flags = worker_flags
    if args.no_gateway and args.gateway_only:
        p.error("--no-gateway and --gateway-only exclude each other")
    if args.no_gateway and not args.gateway_addr:
        p.error("--no-gateway needs --gateway HOST:PORT (or env PDSERVE_GATEWAY)")
    if args.control_port is None:
        args.control_port = 0 if args.port == 0 else args.port + 1
    if args.port_file is None:
        args.port_file = os.path.join(args.log_dir, "gateway.ports")
    pg, dg = _gpu_list(args.prefill_gpus), _gpu_list(args.decode_gpus)
    for role, tp in (("prefill", args.prefill_tp), ("decode", args.decode_tp)):
        if tp < 1:
            p.error(f"--{role}-tp must be >= 1")
    if args.device == "cpu":
        args.prefill_slots = [None] * (args.num_prefill if args.num_prefill is not None else max(1, len(pg)))
        args.decode_slots = [None] * (args.num_decode if args.num_decode is not None else max(1, len(dg)))
    else:
        if args.num_prefill is not None or args.num_decode is not None:
            p.error("on GPUs, give --prefill-gpus/--decode-gpus instead of counts")
        # A TP worker takes tp consecutive GPUs of its list: CUDA_VISIBLE_DEVICES names them, rank r on
        # the r-th.
        for role, gpus, tp in (("prefill", pg, args.prefill_tp), ("decode", dg, args.decode_tp)):
            if len(gpus) % tp:
                p.error(f"--{role}-gpus lists {len(gpus)} GPUs, not a multiple of --{role}-tp {tp}")
        args.prefill_slots = [
            ",".join(pg[i : i + args.prefill_tp]) for i in range(0, len(pg), args.prefill_tp)
        ]
        args.decode_slots = [",".join(dg[i : i + args.decode_tp]) for i in range(0, len(dg), args.decode_tp)]
    if not args.gateway_only and not (args.prefill_slots or args.decode_slots):
        p.error("no workers to start: give --prefill-gpus/--decode-gpus (or --device cpu with counts)")
    if not args.no_gateway and not args.gateway_only and not (args.prefill_slots and args.decode_slots):
        p.error("a local cluster needs at least one prefill and one decode worker")
    return args


def plan(args: argparse.Namespace, control_port: int | None = None) -> list[Child]:
    """Every process to start, gateway first; local workers dial `control_port` (default: the flags').
    The cluster secret's path only goes on a command line, never the secret (env PDSERVE_CLUSTER_SECRET
    passes through)."""
    exe = pdserve_command(python=args.python)
    children = []
    if not args.no_gateway:
        gw = exe + ["gateway", "--host", args.gateway_host, "--port", str(args.port)]
        gw += ["--control-host", args.gateway_host, "--control-port", str(args.control_port)]
        gw += ["--port-file", args.port_file] + passed_on(args, LAUNCH, GATEWAY_CHILD)
        children.append(Child("gateway", gw, {}))
    if args.gateway_only:
        return children
    gateway = args.gateway_addr or f"127.0.0.1:{args.control_port if control_port is None else control_port}"
    n_workers = len(args.prefill_slots) + len(args.decode_slots)
    # Every core for each worker; when they share cores, their forwards take turns (as `pdserve up`;
    # pdserve/launch/cpu_share.py).
    lock = os.path.abspath(os.path.join(args.log_dir, "cpu-forward.lock"))
    cpu = cpu_share(args.threads_per_worker, n_workers, args.cpu_sharing, lock)
    common = passed_on(args, LAUNCH, WORKER_CHILD) + ["--gateway", gateway]
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
            tp = args.prefill_tp if role == "prefill" else args.decode_tp
            if tp > 1:
                argv += ["--tp-size", str(tp)]
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
        sup.say(f"ready ({len(children)} processes, {url or f'gateway {args.gateway_addr}'})")
        return sup.watch()
    finally:
        sup.stop()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
