"""Servers a benchmark starts and stops itself: `pdserve up` (and its variants), `transformers serve` and
llama.cpp's `llama-server`, each in its own process group with its log in a file."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from pdserve.launch.supervisor import pdserve_command


@dataclass
class Launched:
    name: str
    url: str
    proc: subprocess.Popen
    log: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


def pdserve_up_argv(port: int, log_dir: str, *flags: str) -> list[str]:
    """`pdserve up` on `port`, its workers' logs in `log_dir`, then each string of extra flags split."""
    extra = [f for chunk in flags for f in shlex.split(chunk)]
    return pdserve_command("up", "--port", str(port), "--log-dir", log_dir, *extra)


def launch(
    name: str, argv: list[str], port: int, log_dir: str, env: dict[str, str] | None = None
) -> Launched:
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    print(f"launched {name} (pid {proc.pid}): {shlex.join(argv)}; log {log}", flush=True)
    return Launched(name, f"http://127.0.0.1:{port}", proc, log)


def wait_healthy(s: Launched, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.name} exited with {s.proc.returncode}; see {s.log}")
        try:
            # /health is 200 only once a server can serve (pdserve: workers registered); a server
            # without /health (404) is ready when it lists its models.
            health = httpx.get(s.url + "/health", timeout=5).status_code
            if health == 200 or (
                health == 404 and httpx.get(s.url + "/v1/models", timeout=5).status_code == 200
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{s.name} not healthy within {timeout_s:.0f} s; see {s.log}")


def _variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = [tuple(v.split("=", 1)) for v in args.launch_pdserve_variant]
    names = [n for n, *_ in out]
    if any(len(v) != 2 or not v[0] for v in out) or len(set(names)) != len(names):
        raise SystemExit("--launch-pdserve-variant takes NAME=FLAGS, each NAME once")
    if {"pdserve", "transformers"} & set(names):
        raise SystemExit("--launch-pdserve-variant: the names pdserve and transformers are taken")
    return out  # type: ignore[return-value]


def launch_all(args: argparse.Namespace, log_dir: str) -> list[Launched]:
    out = []
    pd = [("pdserve", "")] if args.launch_pdserve else []
    # Variants sit 20 ports up, two apart: each `pdserve up` also takes port + 1 for its control socket.
    for i, (name, flags) in enumerate(pd + _variants(args), start=-len(pd)):
        port = args.launch_port + (20 + 2 * i if i >= 0 else 0)
        argv = pdserve_up_argv(port, os.path.join(log_dir, name), args.pdserve_args, flags)
        out.append(launch(name, argv, port, log_dir))
    if args.launch_transformers_serve:
        from pdserve.model_source import resolve_model_source
        from pdserve.runtime.loader import model_folder

        port = args.launch_port + 10
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        argv = [exe, "serve", model_folder(resolve_model_source(None)), "--continuous-batching",
                "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                *shlex.split(args.transformers_args)]  # fmt: skip
        out.append(launch("transformers", argv, port, log_dir))
    if args.launch_llama_server:
        out.append(launch("llama-server", llama_server_argv(args), args.launch_port + 12, log_dir))
    return out


def llama_server_argv(args: argparse.Namespace) -> list[str]:
    """llama.cpp's `llama-server` on the bundled GGUF (or --llama-server-model), on --launch-port + 12."""
    if not os.access(args.launch_llama_server, os.X_OK):
        raise SystemExit(f"--launch-llama-server: {args.launch_llama_server!r} is not an executable file")
    model = args.llama_server_model
    if model is None:
        from pdserve.model_source import resolve_model_source

        model = resolve_model_source(None).gguf_path
    return [args.launch_llama_server, "-m", str(model), "--host", "127.0.0.1",
            "--port", str(args.launch_port + 12), *shlex.split(args.llama_server_args)]  # fmt: skip
