"""`pdserve up`: a whole cluster on this host (one gateway, P prefill and D decode workers), and the
gateway start that `deploy/launch.py` shares with it. The children are supervised by
`pdserve.launch.supervisor`: a crashed one is restarted, and all of them die with the launcher.

Every socket binds to a host the user gave: HTTP to --host, the gateway's control socket and every
worker's sockets (KV bootstrap, gloo, health) to --internal-host (127.0.0.1 by default, so
a local cluster opens nothing beyond loopback). The children share a cluster secret
(pdserve/cluster_auth.py): --cluster-secret-file, else PDSERVE_CLUSTER_SECRET, else a random one
made here, handed to the children in their environment (never on a command line, which `ps` shows).
--api-key and --admin-api-key reach the gateway the same way (PDSERVE_API_KEY, PDSERVE_ADMIN_API_KEY).
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
from pdserve.gateway.config import elastic_config
from pdserve.launch.cpu_share import CpuShare, cpu_share
from pdserve.launch.flag import GATEWAY_CHILD, UP, WORKER_CHILD
from pdserve.launch.flags import add_flags, passed_on
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
    """Its own flags, the workers' it forwards and the gateway's (`up=True` in gateway/config.py)."""
    add_flags(parser, UP)


def _control_port(args: argparse.Namespace) -> int:
    if args.control_port is not None:
        return int(args.control_port)
    return 0 if args.port == 0 else int(args.port) + 1


def gateway_command(args: argparse.Namespace, port_file: str | None = None) -> list[str]:
    """The gateway's command line: its ports, and every gateway flag given to `pdserve up` (--host
    among them, when not the gateway's own default)."""
    argv = pdserve_command("gateway", "--port", str(args.port))
    argv += ["--control-host", args.internal_host, "--control-port", str(_control_port(args))]
    argv += passed_on(args, UP, GATEWAY_CHILD)
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
    common = passed_on(args, UP, WORKER_CHILD) + ["--gateway", f"{dial}:{control}", "--host", dial]
    common += cpu_plan(args, lock_path).flags()
    cmds = [("gateway", gateway_command(args))]
    for i in range(args.num_prefill):
        name = f"prefill-{i}"
        tp = ["--tp-size", str(args.prefill_tp)] if args.prefill_tp > 1 else []
        cmds.append(
            (
                name,
                exe + ["prefill", "--worker-id", name, "--disaggregation-bootstrap-port", "0"] + tp + common,
            )
        )
    for i in range(args.num_decode):
        name = f"decode-{i}"
        tp = ["--tp-size", str(args.decode_tp)] if args.decode_tp > 1 else []
        cmds.append((name, exe + ["decode", "--worker-id", name] + tp + common))
    return cmds


def secret_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's cluster secret: none to add when given by file or environment, else a fresh one."""
    if args.cluster_secret_file or env.cluster_secret() is not None:
        return {}
    return {env.CLUSTER_SECRET_VAR: secrets.token_urlsafe(32)}


def key_env(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's API keys given as flags, as the variables it reads (gateway/config.py); a flag
    wins over the variable the launcher inherited."""
    keys = {"PDSERVE_API_KEY": args.api_key, "PDSERVE_ADMIN_API_KEY": args.admin_api_key}
    return {name: key for name, key in keys.items() if key}


def _opened(url: str, args: argparse.Namespace, control: int) -> str:
    """What the cluster listens on, for the start-up message (worker ports as the gateway lists them).
    `/workers` is an admin endpoint: asked with the key the gateway takes for it (gateway/api/auth.py:
    the admin key, else the API key), from the environment the gateway inherits; never printed."""
    lines = [f"  HTTP          {url}", f"  control       {args.internal_host}:{control} (CurveZMQ)"]
    key = args.admin_api_key or env.admin_api_key() or args.api_key or env.api_key()
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


def tp_split_error(args: argparse.Namespace) -> str | None:
    """Why --prefill-tp or --decode-tp cannot split the model, before any worker starts (a worker
    would refuse it and be restarted again and again); None when both can."""
    sizes = {"--prefill-tp": args.prefill_tp, "--decode-tp": args.decode_tp}
    for flag, n in sizes.items():
        if n < 1:
            return f"{flag} must be >= 1"
    if all(n == 1 for n in sizes.values()):
        return None
    from pdserve.model_source import ModelSourceError, resolve_model_source
    from pdserve.runtime.loader import load_hf_config, model_folder
    from pdserve.runtime.model_config import ModelSpec
    from pdserve.runtime.tp_layout import TPLayout, TPLayoutError

    try:
        spec = ModelSpec.from_hf_config(load_hf_config(model_folder(resolve_model_source(args.model_path))))
    except (ModelSourceError, OSError, ValueError) as e:
        return f"cannot read the model to check its TP split: {e}"
    for flag, n in sizes.items():
        try:
            TPLayout.of(spec, n)
        except TPLayoutError as e:
            return f"{flag} {n}: {e}"
    return None


def main(args: argparse.Namespace) -> int:
    for name in ("num_prefill", "num_decode"):
        if getattr(args, name) < 1:
            print(f"pdserve up: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    why = tp_split_error(args)
    if why:
        print(f"pdserve up: {why}", file=sys.stderr)
        return 2
    try:
        elastic_config(args)
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
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
                    sup,
                    Child("gateway", gateway_command(args, port_file), {**secret, **key_env(args)}),
                    port_file,
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
