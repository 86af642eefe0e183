"""Launching a cluster: the process supervision shared by `pdserve up` and `deploy/launch.py`, and
`pdserve up` itself (one gateway, P prefill and D decode workers on this host).

Every child runs in a session of its own, so a terminal's Ctrl-C reaches the launcher only, which
then drains the children, and a child's whole process group can be stopped at once. Every child
also dies with its launcher, even when the launcher is SIGKILLed (Linux `PR_SET_PDEATHSIG`), so an
interrupted launcher leaves no orphans behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.config import add_runtime_args
from pdserve.port_file import wait_port_file

_PR_SET_PDEATHSIG = 1
# Loaded once here: a forked child should not have to dlopen anything before it execs.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@dataclass(frozen=True)
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]  # added to the launcher's environment


def die_with(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: the kernel SIGKILLs the child when the thread that started it exits."""

    def arm() -> None:
        if _LIBC is None:  # not Linux: the launcher's own stop() still applies
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return arm


def spawn(argv: list[str], log_path: str | None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` in its own session, dying with this process; output appended to `log_path`."""
    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )
    finally:
        if out:
            out.close()


def signal_group(p: subprocess.Popen, sig: int) -> None:
    # The group id is the child's pid (its own session); it outlives the leader while members remain.
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """The children of one launcher: start, watch, stop (workers first, then the gateway)."""

    def __init__(self, log_dir: str | None, stop_timeout_s: float, prefix: str = "launch") -> None:
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.prefix = prefix
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def handle_signals(self) -> None:
        def on_signal(signum: int, frame: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def say(self, text: str, error: bool = False) -> None:
        print(f"{self.prefix}: {text}", file=sys.stderr if error else sys.stdout, flush=True)

    def start(self, c: Child) -> subprocess.Popen:
        path = os.path.join(self.log_dir, f"{c.name}.log") if self.log_dir else None
        p = spawn(c.argv, path, c.env)
        self.procs[c.name] = p
        self.say(f"started {c.name} pid {p.pid}" + (f" log {path}" if path else ""))
        return p

    def failed(self) -> str | None:
        """Why the cluster cannot go on, or None; forgets workers that drained and exited cleanly."""
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            if rc == 0 and name != "gateway":
                self.say(f"{name} exited after draining")
                del self.procs[name]
                continue
            return f"{name} exited with {rc}"
        return None

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> str | None:
        """Poll `ready` until it holds; None then, else why it never will (a child died, a signal, time)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            why = self.failed() or ("stopped" if self.stopping else None)
            if why is None and time.monotonic() > deadline:
                why = f"not healthy within {timeout_s:.0f} s"
            if why:
                return why
            time.sleep(0.5)
        return None

    def watch(self) -> int:
        """Until a signal (0) or a child fails (1)."""
        while not self.stopping:
            why = self.failed()
            if why:
                self.say(f"{why}; stopping everything", error=True)
                return 1
            time.sleep(0.5)
        return 0

    def stop(self) -> None:
        """SIGTERM each process group, workers before the gateway so they can finish and deregister;
        SIGKILL whatever is left after the grace."""
        order = sorted(self.procs.items(), key=lambda kv: kv[0] == "gateway")
        for name, p in order:
            if name == "gateway" and any(q.poll() is None for n, q in order if n != "gateway"):
                _wait([q for n, q in order if n != "gateway"], self.stop_timeout_s)
            signal_group(p, signal.SIGTERM)
        _wait([p for _, p in order], self.stop_timeout_s)
        for _, p in order:
            signal_group(p, signal.SIGKILL)  # whatever is left in each group, leader or not
            p.wait()


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def start_gateway(sup: Supervisor, gateway: Child, port: int, control_port: int, port_file: str) -> int:
    """Start the gateway; the control port the workers must dial (read back when asked for port 0)."""
    p = sup.start(gateway)
    if port != 0 and control_port != 0:
        return control_port
    return wait_port_file(port_file, p)["control_port"]


# --- `pdserve up` -----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_runtime_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address of the gateway")
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
        help="torch threads per worker (default: cores split evenly among workers; more than that "
        "shares cores, with idle OpenMP threads sleeping)",
    )
    parser.add_argument("--served-model-name", default="default")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-dir", default=None, help="write each role's output to <dir>/<role>.log")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--stop-timeout", type=float, default=15.0, help="seconds to let workers drain")
    parser.add_argument("--transfer-timeout", type=float, default=30.0)
    parser.add_argument("--kv-wait-timeout", type=float, default=300.0)


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


def _control_port(args: argparse.Namespace) -> int:
    if args.control_port is not None:
        return args.control_port
    return 0 if args.port == 0 else args.port + 1


def gateway_command(args: argparse.Namespace, port_file: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.cli", "gateway", "--host", args.host, "--port", str(args.port)]
    argv += ["--control-port", str(_control_port(args))]
    argv += ["--served-model-name", args.served_model_name, "--log-level", args.log_level]
    if args.model_path:
        argv += ["--model-path", args.model_path]
    if port_file:
        argv += ["--port-file", port_file]
    return argv


def worker_commands(args: argparse.Namespace, control_port: int | None = None) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child, gateway first; workers dial `control_port` (default: the flags')."""
    exe = [sys.executable, "-m", "pdserve.cli"]
    control = _control_port(args) if control_port is None else control_port
    common = _flags(args, _FORWARDED) + [
        "--gateway",
        f"127.0.0.1:{control}",
        "--num-threads",
        str(_threads(args)),
        "--log-level",
        args.log_level,
        "--transfer-timeout",
        str(args.transfer_timeout),
        "--kv-wait-timeout",
        str(args.kv_wait_timeout),
    ]
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
    if shared and "OMP_WAIT_POLICY" not in os.environ:
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
    sup = Supervisor(args.log_dir, args.stop_timeout, prefix="pdserve up")
    sup.handle_signals()
    env = worker_env(args)
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as tmp:
        port_file = args.port_file or os.path.join(tmp, "gateway.ports")
        try:
            try:
                gateway = Child("gateway", gateway_command(args, port_file), {})
                control = start_gateway(sup, gateway, args.port, _control_port(args), port_file)
            except (RuntimeError, TimeoutError) as e:
                sup.say(f"the gateway did not start: {e}", error=True)
                return 1
            port = args.port or wait_port_file(port_file)["port"]
            for name, argv in worker_commands(args, control)[1:]:
                sup.start(Child(name, argv, env))
            url = f"http://{args.host}:{port}"
            why = sup.wait_until(lambda: _healthy(url), args.startup_timeout)
            if why:
                sup.say(f"the cluster did not become healthy: {why}", error=True)
                return 1
            print(
                f"pdserve is up at {url} ({args.num_prefill} prefill, {args.num_decode} decode); "
                f"try: curl {url}/v1/models",
                flush=True,
            )
            return sup.watch()
        finally:
            sup.stop()
