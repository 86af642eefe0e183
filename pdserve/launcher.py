"""`pdserve up`: a whole cluster on this host: one gateway, P prefill and D decode workers.

Each role runs as a child process in its own process group; the launcher waits for /health,
prints the URL, and on Ctrl-C / SIGTERM stops exactly the processes it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

from pdserve import env
from pdserve.config import TRANSFER_TIMEOUT_S, WAITING_TIMEOUT_S, add_runtime_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_runtime_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address of the gateway")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--control-port", type=int, default=None, help="gateway control socket (default port+1)"
    )
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="torch threads per worker (default: cores split evenly among workers; more than that "
        "shares cores, with idle OpenMP threads sleeping)",
    )
    parser.add_argument("--served-model-name", default="default")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-dir", default=None, help="write each role's output to <dir>/<role>.log")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--transfer-timeout", type=float, default=TRANSFER_TIMEOUT_S)
    parser.add_argument(
        "--waiting-timeout",
        "--kv-wait-timeout",
        dest="waiting_timeout",
        type=float,
        default=WAITING_TIMEOUT_S,
    )


# Runtime flags forwarded verbatim to every worker.
_FORWARDED = [
    "model_path",
    "dtype",
    "device",
    "page_size",
    "max_total_tokens",
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "attention_backend",
    "context_length",
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
]


def _flags(args: argparse.Namespace, names: list[str]) -> list[str]:
    out = []
    for n in names:
        v = getattr(args, n)
        if v is not None:
            out += [f"--{n.replace('_', '-')}", str(v)]
    return out


def worker_commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child, gateway first."""
    exe = [sys.executable, "-m", "pdserve.cli"]
    control = args.control_port or args.port + 1
    gw = exe + [
        "gateway",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--control-port",
        str(control),
        "--served-model-name",
        args.served_model_name,
        "--log-level",
        args.log_level,
    ]
    if args.model_path:
        gw += ["--model-path", args.model_path]
    threads = _threads(args)
    common = _flags(args, _FORWARDED) + [
        "--gateway",
        f"127.0.0.1:{control}",
        "--num-threads",
        str(threads),
        "--log-level",
        args.log_level,
        "--transfer-timeout",
        str(args.transfer_timeout),
        "--waiting-timeout",
        str(args.waiting_timeout),
    ]
    cmds = [("gateway", gw)]
    for i in range(args.num_prefill):
        cmds.append(
            (
                f"prefill-{i}",
                exe
                + ["prefill", "--worker-id", f"prefill-{i}", "--disaggregation-bootstrap-port", "0"]
                + common,
            )
        )
    for i in range(args.num_decode):
        cmds.append((f"decode-{i}", exe + ["decode", "--worker-id", f"decode-{i}"] + common))
    return cmds


def _threads(args: argparse.Namespace) -> int:
    workers = args.num_prefill + args.num_decode
    return args.threads_per_worker or max(1, (os.cpu_count() or 2) // workers)


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """Extra environment for the children. When the workers' threads outnumber the cores (an explicit
    --threads-per-worker above the even split), their OpenMP threads sleep when idle instead of spinning
    (OMP_WAIT_POLICY=PASSIVE, unless the user chose), so a busy worker gets the cores an idle one leaves:
    on two cores, two threads per worker then serve 25% more in a burst of 32 requests than the even
    split, where spinning threads made the same setting 25% slower (docs/benchmarks.md)."""
    shared = (args.num_prefill + args.num_decode) * _threads(args) > (os.cpu_count() or 1)
    if shared and not env.omp_wait_policy_set():
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def main(args: argparse.Namespace) -> int:
    for name in ("num_prefill", "num_decode"):
        if getattr(args, name) < 1:
            print(f"pdserve up: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    children: list[tuple[str, subprocess.Popen]] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    url = f"http://{args.host}:{args.port}"
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    env = {**os.environ, **worker_env(args)}
    try:
        for name, argv in worker_commands(args):
            out = open(os.path.join(args.log_dir, f"{name}.log"), "ab") if args.log_dir else None
            # Own process group: a terminal's Ctrl-C reaches the launcher only, which then drains the children.
            children.append(
                (
                    name,
                    subprocess.Popen(
                        argv,
                        stdout=out,
                        stderr=subprocess.STDOUT if out else None,
                        start_new_session=True,
                        env=env,
                    ),
                )
            )
        deadline = time.monotonic() + args.startup_timeout
        while not _healthy(url):
            dead = [(n, p.returncode) for n, p in children if p.poll() is not None]
            if dead or stopping or time.monotonic() > deadline:
                why = (
                    f"{dead[0][0]} exited with {dead[0][1]}"
                    if dead
                    else "stopped"
                    if stopping
                    else "timed out"
                )
                print(f"pdserve up: the cluster did not become healthy: {why}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(
            f"pdserve is up at {url} ({args.num_prefill} prefill, {args.num_decode} decode); "
            f"try: curl {url}/v1/models",
            flush=True,
        )
        while not stopping:
            dead = [(n, p.returncode) for n, p in children if p.poll() is not None]
            if dead:
                print(f"pdserve up: {dead[0][0]} exited with {dead[0][1]}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop_children(children)


def _stop_children(children: list[tuple[str, subprocess.Popen]], grace_s: float = 15.0) -> None:
    """SIGTERM each child's process group (workers drain), then SIGKILL what is left after the grace."""
    for _, p in children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for _, p in children:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
