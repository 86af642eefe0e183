"""`pdserve up`: a whole cluster on this host (one gateway, P prefill and D decode workers), and the
gateway start that `deploy/launch.py` shares with it. The children are supervised by
`pdserve.launch.supervisor`: a crashed one is restarted, and all of them die with the launcher.

Every socket binds to a host the user gave: HTTP to --host, the gateway's control socket and every
worker's sockets (KV bootstrap, gloo, health) to --internal-host (127.0.0.1 by default, so
a local cluster opens nothing beyond loopback). The children share a cluster secret
(pdserve/cluster_auth.py): --cluster-secret-file, else PDSERVE_CLUSTER_SECRET, else a random one
made here, handed to the children in their environment (never on a command line, which `ps` shows).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import urllib.request

from pdserve import env
from pdserve.cluster_auth import add_secret_arg
from pdserve.config import KV_TRANSPORTS, TRANSFER_TIMEOUT_S, WAITING_TIMEOUT_S, add_runtime_args
from pdserve.gateway.config import add_trace_args
from pdserve.launch.cpu_share import CPU_SHARING, CpuShare, cpu_share
from pdserve.launch.supervisor import Child, RestartPolicy, Supervisor, pdserve_command, role_of
from pdserve.port_file import wait_port_file


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def start_gateway(sup: Supervisor, gateway: Child, port_file: str) -> tuple[int, int]:
    """Start the gateway; (HTTP port, control port) it bound. A restarted gateway binds the same
    ports again, even when the first start asked for port 0, so clients and workers find it."""
    p = sup.start(gateway)
    port = int(gateway.argv[gateway.argv.index("--port") + 1])
    control = int(gateway.argv[gateway.argv.index("--control-port") + 1])
    if port == 0 or control == 0:
        ports = wait_port_file(port_file, p)
        port, control = ports["port"], ports["control_port"]
        argv = _with_flag(_with_flag(gateway.argv, "--port", str(port)), "--control-port", str(control))
        sup.set_argv("gateway", argv)
    return port, control


# --- `pdserve up` -----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_runtime_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address of the gateway")
    parser.add_argument(
        "--internal-host",
        default="127.0.0.1",
        help="bind address of the gateway's control socket and of every worker socket (KV bootstrap, "
        "gloo, health); 0.0.0.0 only if other hosts must reach them",
    )
    add_secret_arg(parser)
    parser.add_argument("--port", type=int, default=30000, help="gateway HTTP port (0: any free port)")
    parser.add_argument(
        "--control-port", type=int, default=None, help="gateway control socket (default port+1; 0: any)"
    )
    parser.add_argument(
        "--port-file",
        default=None,
        help='the gateway writes {"port": ..., "control_port": ...} here once bound',
    )
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="torch threads per worker (default: every core; co-located workers share the cores, "
        "see --cpu-sharing)",
    )
    parser.add_argument(
        "--cpu-sharing",
        default="turns",
        choices=list(CPU_SHARING),
        help="when the workers' threads outnumber the cores: turns (one forward at a time, threads spin "
        "briefly) or passive (forwards overlap, idle prefill threads sleep at once); see "
        "pdserve/launch/cpu_share.py",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the model's own)"
    )
    parser.add_argument("--tool-call-parser", default=None, help="see `pdserve gateway --help`")
    parser.add_argument("--reasoning-parser", default=None, help="see `pdserve gateway --help`")
    parser.add_argument(
        "--prefill-policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "least_load"],
        help="how the gateway picks a prefill worker (see `pdserve gateway --help`)",
    )
    parser.add_argument(
        "--decode-policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "least_load"],
        help="how the gateway picks a decode worker (see `pdserve gateway --help`)",
    )
    parser.add_argument(
        "--disaggregation-min-prefill-tokens",
        type=int,
        default=0,
        help="prompts with fewer uncached tokens are computed on the decode worker (0: off)",
    )
    parser.add_argument(
        "--disaggregation-max-prefill-queue",
        type=int,
        default=0,
        help="past this many requests in flight on every prefill worker, decode computes the prompt (0: off)",
    )
    limits = parser.add_argument_group(
        "the gateway's limits (see `pdserve gateway --help`; default: its own)"
    )
    for flag, kind in _GATEWAY_LIMITS:
        limits.add_argument(flag, type=kind, default=None)
    add_trace_args(parser)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-dir", default=None, help="write each role's output to <dir>/<role>.log")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--stop-timeout", type=float, default=15.0, help="seconds to let workers drain")
    policy = RestartPolicy()
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=policy.max_restarts,
        help=f"restarts of a crashing child within {policy.window_s:.0f} s after which it is crash-looping: "
        f"retried every {policy.backoff_max_s:.0f} s (never given up on; the launcher goes on)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=policy.backoff_initial_s,
        help=f"seconds before the first restart of a crashed child; doubles each time, up to "
        f"{policy.backoff_max_s:.0f} s",
    )
    parser.add_argument("--transfer-timeout", type=float, default=TRANSFER_TIMEOUT_S)
    parser.add_argument(
        "--waiting-timeout",
        "--kv-wait-timeout",
        dest="waiting_timeout",
        type=float,
        default=WAITING_TIMEOUT_S,
    )
    parser.add_argument(
        "--kv-transfer-backend",
        default="auto",
        choices=["auto", "gloo", "nccl"],
        help="the pair group's backend (see `pdserve decode --help`); gloo where prefill and decode share "
        "one GPU, since NCCL cannot pair two ranks on the same device",
    )
    parser.add_argument(
        "--kv-transport",
        default="auto",
        choices=list(KV_TRANSPORTS),
        help="how KV pages go from prefill to decode workers: auto = shared memory between these "
        "same-host workers (CPU pools), else the torch.distributed pair group; dist: the pair group only",
    )


# The gateway's limit flags `pdserve up` takes and forwards when given.
_GATEWAY_LIMITS: list[tuple[str, type]] = [
    ("--max-pending-generations", int),
    ("--max-requests-per-client", int),
    ("--max-request-bytes", int),
    ("--max-inflight-body-bytes", int),
    ("--max-generations-per-request", int),
    ("--request-body-timeout", float),
    ("--idle-timeout", float),
    ("--request-timeout", float),
]

# Runtime flags forwarded verbatim to every worker.
_FORWARDED = [
    "model_path",
    "dtype",
    "quantization",
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
    "disable_radix_cache",
    "grammar_backend",
    "enable_torch_compile",
]


def _flags(args: argparse.Namespace, names: list[str]) -> list[str]:
    out = []
    for n in names:
        v = getattr(args, n)
        if v is True:  # a store_true flag
            out.append(f"--{n.replace('_', '-')}")
        elif v is not None and v is not False:
            out += [f"--{n.replace('_', '-')}", str(v)]
    return out


def _control_port(args: argparse.Namespace) -> int:
    if args.control_port is not None:
        return int(args.control_port)
    return 0 if args.port == 0 else int(args.port) + 1


def gateway_command(args: argparse.Namespace, port_file: str | None = None) -> list[str]:
    argv = pdserve_command("gateway", "--host", args.host, "--port", str(args.port))
    argv += ["--control-host", args.internal_host, "--control-port", str(_control_port(args))]
    argv += _secret_flag(args)
    argv += ["--log-level", args.log_level]
    argv += ["--prefill-policy", args.prefill_policy, "--decode-policy", args.decode_policy]
    argv += ["--disaggregation-min-prefill-tokens", str(args.disaggregation_min_prefill_tokens)]
    argv += ["--disaggregation-max-prefill-queue", str(args.disaggregation_max_prefill_queue)]
    for flag, value in (
        ("--served-model-name", args.served_model_name),
        ("--tool-call-parser", args.tool_call_parser),
        ("--reasoning-parser", args.reasoning_parser),
    ):
        if value:
            argv += [flag, value]
    argv += ["--grammar-backend", args.grammar_backend]
    argv += ["--grammar-compile-timeout", str(args.grammar_compile_timeout_s)]
    argv += _flags(args, [flag[2:].replace("-", "_") for flag, _ in _GATEWAY_LIMITS])
    if getattr(args, "enable_trace", False):
        argv += ["--enable-trace", "--otlp-traces-endpoint", args.otlp_traces_endpoint]
        if args.otlp_traces_protocol:
            argv += ["--otlp-traces-protocol", args.otlp_traces_protocol]
    if args.model_path:
        argv += ["--model-path", args.model_path]
    if port_file:
        argv += ["--port-file", port_file]
    return argv


def worker_commands(
    args: argparse.Namespace, control_port: int | None = None, lock_path: str = ""
) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child, gateway first; workers dial `control_port` (default: the flags')
    and, when they take turns at the cores, lock `lock_path` (pdserve/launch/cpu_share.py)."""
    exe = pdserve_command()
    control = _control_port(args) if control_port is None else control_port
    dial = "127.0.0.1" if args.internal_host in ("0.0.0.0", "::") else args.internal_host
    common = (
        _flags(args, _FORWARDED)
        + [
            "--gateway",
            f"{dial}:{control}",
            "--host",
            dial,
            "--log-level",
            args.log_level,
            "--transfer-timeout",
            str(args.transfer_timeout),
            "--waiting-timeout",
            str(args.waiting_timeout),
            "--kv-transport",
            args.kv_transport,
            "--kv-transfer-backend",
            args.kv_transfer_backend,
            "--grammar-compile-timeout",
            str(args.grammar_compile_timeout_s),
        ]
        + _secret_flag(args)
        + cpu_plan(args, lock_path).flags()
    )
    cmds = [("gateway", gateway_command(args))]
    for i in range(args.num_prefill):
        name = f"prefill-{i}"
        cmds.append(
            (name, exe + ["prefill", "--worker-id", name, "--disaggregation-bootstrap-port", "0"] + common)
        )
    for i in range(args.num_decode):
        name = f"decode-{i}"
        cmds.append((name, exe + ["decode", "--worker-id", name] + common))
    return cmds


def _secret_flag(args: argparse.Namespace) -> list[str]:
    return ["--cluster-secret-file", args.cluster_secret_file] if args.cluster_secret_file else []


def secret_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's cluster secret: none to add when given by file or environment, else a fresh one."""
    if args.cluster_secret_file or env.cluster_secret() is not None:
        return {}
    return {env.CLUSTER_SECRET_VAR: secrets.token_urlsafe(32)}


def _opened(url: str, args: argparse.Namespace, control: int) -> str:
    """What the cluster listens on, for the start-up message (worker ports as the gateway lists them).
    `/workers` is an admin endpoint: asked with the key the gateway takes for it (gateway/auth.py:
    the admin key, else the API key), from the environment the gateway inherits; never printed."""
    lines = [f"  HTTP          {url}", f"  control       {args.internal_host}:{control} (CurveZMQ)"]
    key = env.admin_api_key() or env.api_key()
    req = urllib.request.Request(url + "/workers", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            workers = json.loads(r.read()).get("workers", [])
        for w in workers:
            if w.get("bootstrap_addr"):
                lines.append(f"  KV bootstrap  {w['bootstrap_addr']} ({w.get('worker_id')}; CurveZMQ)")
    except (OSError, ValueError) as e:  # said, not silently dropped: the lines above still hold
        lines.append(f"  KV bootstrap  (not listed: /workers answered {e})")
    lines.append(f"  workers       gloo pair groups: {args.internal_host}, free ports")
    return "\n".join(lines)


def cpu_plan(args: argparse.Namespace, lock_path: str = "") -> CpuShare:
    """How this cluster's workers share the host's cores (pdserve/launch/cpu_share.py)."""
    return cpu_share(args.threads_per_worker, args.num_prefill + args.num_decode, args.cpu_sharing, lock_path)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            status: int = r.status
            return status == 200
    except OSError:
        return False


def main(args: argparse.Namespace) -> int:
    for name in ("num_prefill", "num_decode"):
        if getattr(args, name) < 1:
            print(f"pdserve up: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.max_restarts < 0 or not args.restart_backoff > 0:
        print("pdserve up: --max-restarts must be >= 0 and --restart-backoff > 0", file=sys.stderr)
        return 2
    policy = RestartPolicy(
        backoff_initial_s=args.restart_backoff,
        backoff_max_s=max(RestartPolicy.backoff_max_s, args.restart_backoff),
        max_restarts=args.max_restarts,
    )
    sup = Supervisor(args.log_dir, args.stop_timeout, prefix="pdserve up", policy=policy)
    sup.handle_signals()
    secret = secret_env(args)
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as tmp:
        cpu = cpu_plan(args, os.path.join(tmp, "cpu-forward.lock"))
        port_file = args.port_file or os.path.join(tmp, "gateway.ports")
        try:
            try:
                port, control = start_gateway(
                    sup, Child("gateway", gateway_command(args, port_file), secret), port_file
                )
            except (RuntimeError, TimeoutError) as e:
                sup.say(f"the gateway did not start: {e}", error=True)
                return 1
            for name, argv in worker_commands(args, control, cpu.lock_path)[1:]:
                sup.start(Child(name, argv, {**cpu.env(role_of(name)), **secret}))
            url = f"http://{args.host}:{port}"
            why = sup.wait_until(lambda: _healthy(url), args.startup_timeout)
            if sup.stopping:  # Ctrl-C or SIGTERM before the cluster was up: a requested stop
                return 0
            if why:
                sup.say(f"the cluster did not become healthy: {why}", error=True)
                return 1
            print(
                f"pdserve is up at {url} ({args.num_prefill} prefill, {args.num_decode} decode); "
                f"try: curl {url}/v1/models\n{_opened(url, args, control)}",
                flush=True,
            )
            return sup.watch()
        finally:
            sup.stop()
