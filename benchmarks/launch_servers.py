"""Servers a benchmark starts and stops itself: `pdserve up` (and its variants), `transformers serve` and
llama.cpp's `llama-server`, each in its own process group with its log in a file.

`start_in_turn` starts them one at a time, each only once the one before is healthy, so that their
loads (reading and repacking weights, quantizing, calibrating) do not compete for the same cores, and
records each one's start (`StartUp`): the time from spawn to its first healthy answer, the peak PSS of
its process tree meanwhile (sampled every 0.5 s), whether a `pdserve up` started cold (--cold-start:
an empty PDSERVE_CACHE_DIR, so no quantized-weights cache) and how much of its weight files the OS page
cache held at spawn (the benchmark does not drop that cache: it takes root).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from pdserve import env
from pdserve.bench.page_cache import cached_share, weight_files
from pdserve.bench.process_memory import MemorySampler
from pdserve.launch.supervisor import pdserve_command

# How often a starting server's health is asked: the resolution of its start-to-healthy time.
HEALTH_POLL_S = 0.25


@dataclass
class StartUp:
    """How one launched server started."""

    healthy_s: float  # from spawn to its first healthy answer
    peak_pss: int | None  # bytes: the highest PSS of its process tree sampled until then
    cold: bool | None  # `pdserve up`: True with an empty cache folder (--cold-start); other servers None
    page_cache_share: float | None  # of its weight files' bytes, in the OS page cache at spawn


@dataclass
class Planned:
    """A server to start: its command line, port and environment, and what its start is judged by."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] | None = None
    workers: int | None = None  # `pdserve up`: how many workers must be in rotation
    weights: list[str] = field(default_factory=list)  # the files it reads its weights from
    cold: bool | None = None  # as StartUp.cold


@dataclass
class Launched:
    name: str
    url: str
    proc: subprocess.Popen
    log: str
    spawned_at: float = field(default_factory=time.monotonic)
    workers: int | None = None  # as Planned.workers
    scratch: str | None = None  # a folder made for this launch (a cold start's cache), removed at stop
    start: StartUp | None = None  # set by start_in_turn

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
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def pdserve_up_argv(port: int, log_dir: str, *flags: str) -> list[str]:
    """`pdserve up` on `port`, its workers' logs in `log_dir`, then each string of extra flags split."""
    extra = [f for chunk in flags for f in shlex.split(chunk)]
    return pdserve_command("up", "--port", str(port), "--log-dir", log_dir, *extra)


def launch(
    name: str, argv: list[str], port: int, log_dir: str, env: dict[str, str] | None = None
) -> Launched:
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "ab") as out:  # the child keeps its own descriptor
        spawned_at = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    print(f"launched {name} (pid {proc.pid}): {shlex.join(argv)}; log {log}", flush=True)
    return Launched(name, f"http://127.0.0.1:{port}", proc, log, spawned_at)


def cold_cache_dir() -> str:
    """An empty cache folder for a cold start, beside pdserve's usual one (the same disk a real first
    start writes its caches to; /tmp may be memory, which would count in the server's PSS)."""
    parent = os.path.dirname(os.path.abspath(env.cache_dir()))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix="pdserve-cold-start-", dir=parent)


def launch_planned(p: Planned, log_dir: str) -> Launched:
    """Spawn `p`; a cold one in its own empty PDSERVE_CACHE_DIR, removed when it is stopped."""
    child_env, scratch = p.env, None
    if p.cold:
        scratch = cold_cache_dir()
        child_env = {**(p.env if p.env is not None else os.environ), "PDSERVE_CACHE_DIR": scratch}
    try:
        s = launch(p.name, p.argv, p.port, log_dir, child_env)
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    s.workers, s.scratch = p.workers, scratch
    return s


def workers_in_rotation(url: str) -> int | None:
    """How many workers a pdserve gateway lists as healthy (in rotation); None where /workers does not
    answer (it is an admin endpoint: a cluster started with a key refuses it)."""
    r = httpx.get(url + "/workers", timeout=5)
    if r.status_code != 200:
        return None
    return sum(int(w.get("state") == "healthy") for w in r.json().get("workers", []))


def is_healthy(s: Launched) -> bool:
    """Whether `s` can serve now. /health is 200 only once a server can serve (pdserve: a prefill and a
    decode worker in rotation, each registered after loading its weights; llama-server: model loaded);
    a `pdserve up` of more workers counts once /workers lists all of them in rotation. A server without
    /health (404) is ready when it lists its models."""
    health = httpx.get(s.url + "/health", timeout=5).status_code
    if health == 404:
        return httpx.get(s.url + "/v1/models", timeout=5).status_code == 200
    if health != 200:
        return False
    if s.workers is None:
        return True
    live = workers_in_rotation(s.url)
    return live is None or live >= s.workers


def wait_healthy(s: Launched, timeout_s: float) -> float:
    """Wait until `s` can serve (`is_healthy`); returns the seconds from its spawn to then (to within
    HEALTH_POLL_S and one request)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.name} exited with {s.proc.returncode}; see {s.log}")
        try:
            if is_healthy(s):
                return time.monotonic() - s.spawned_at
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"{s.name} not healthy within {timeout_s:.0f} s; see {s.log}")


def start_one(p: Planned, log_dir: str, timeout_s: float, interval_s: float = 0.5) -> Launched:
    """Launch `p`, sample its tree's PSS every `interval_s` until it is healthy; its `start` set."""
    share = cached_share(p.weights) if p.weights else None
    s = launch_planned(p, log_dir)
    sampler = MemorySampler({p.name: s.proc.pid}, interval_s).start()
    try:
        healthy_s = wait_healthy(s, timeout_s)
        peak = sampler.take_peaks().get(p.name)
    except BaseException:
        s.stop()
        raise
    finally:
        sampler.stop()
    s.start = StartUp(healthy_s, peak or None, p.cold, share)
    return s


def start_in_turn(
    planned: list[Planned], log_dir: str, timeout_s: float, said: Callable[[Launched], None] = lambda s: None
) -> list[Launched]:
    """Start each of `planned` once the one before is healthy (`start_one`), calling `said` on each;
    on a failure, every server already started is stopped before the error goes on."""
    out: list[Launched] = []
    try:
        for p in planned:
            out.append(start_one(p, log_dir, timeout_s))
            said(out[-1])
    except BaseException:
        for s in out:
            s.stop()
        raise
    return out


def _variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = [tuple(v.split("=", 1)) for v in args.launch_pdserve_variant]
    names = [n for n, *_ in out]
    if any(len(v) != 2 or not v[0] for v in out) or len(set(names)) != len(names):
        raise SystemExit("--launch-pdserve-variant takes NAME=FLAGS, each NAME once")
    if {"pdserve", "transformers"} & set(names):
        raise SystemExit("--launch-pdserve-variant: the names pdserve and transformers are taken")
    return out  # type: ignore[return-value]


def pdserve_plan(name: str, argv: list[str], port: int, cold: bool) -> Planned:
    """A `pdserve up` to start: the workers it must have in rotation and the weights it reads, from its
    own flags (pdserve up's parser, so defaults and PDSERVE_MODEL_PATH count as they do for it)."""
    from pdserve.launch.up import add_cli_args
    from pdserve.model_source import ModelSourceError, resolve_model_source

    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    flags, _ = parser.parse_known_args(argv[argv.index("up") + 1 :])
    try:
        src = resolve_model_source(flags.model_path or env.model_path())
        weights = weight_files(src.gguf_path or src.folder)
    except ModelSourceError:
        weights = []  # `pdserve up` itself says what is wrong with it
    return Planned(name, argv, port, workers=flags.num_prefill + flags.num_decode, weights=weights, cold=cold)


def plan_launches(args: argparse.Namespace, log_dir: str) -> list[Planned]:
    """Every server the flags ask for, in the order they start: pdserve, its variants, transformers
    serve, llama-server."""
    out = []
    pd = [("pdserve", "")] if args.launch_pdserve else []
    # Variants sit 20 ports up, two apart: each `pdserve up` also takes port + 1 for its control socket.
    for i, (name, flags) in enumerate(pd + _variants(args), start=-len(pd)):
        port = args.launch_port + (20 + 2 * i if i >= 0 else 0)
        argv = pdserve_up_argv(port, os.path.join(log_dir, name), args.pdserve_args, flags)
        out.append(pdserve_plan(name, argv, port, args.cold_start))
    if args.launch_transformers_serve:
        from pdserve.model_source import resolve_model_source
        from pdserve.runtime.loader import model_folder

        port = args.launch_port + 10
        folder = model_folder(resolve_model_source(None))
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        argv = [exe, "serve", folder, "--continuous-batching",
                "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                *shlex.split(args.transformers_args)]  # fmt: skip
        out.append(Planned("transformers", argv, port, weights=weight_files(folder)))
    if args.launch_llama_server:
        argv = llama_server_argv(args)
        weights = weight_files(argv[argv.index("-m") + 1])
        out.append(Planned("llama-server", argv, args.launch_port + 12, weights=weights))
    return out


def launch_all(args: argparse.Namespace, log_dir: str) -> list[Launched]:
    """Every planned server spawned at once (wait for each with `wait_healthy`); `start_in_turn` is the
    one at a time start that times each."""
    return [launch_planned(p, log_dir) for p in plan_launches(args, log_dir)]


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


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """The flags of the servers a benchmark launches itself (`pdserve bench serving` and `goodput`)."""
    p.add_argument("--launch-pdserve", action="store_true", help="start `pdserve up` and stop it at the end")
    p.add_argument("--pdserve-args", default="", help="extra flags for the launched `pdserve up`")
    p.add_argument("--launch-pdserve-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="start another `pdserve up` with --pdserve-args plus FLAGS, as target NAME "
                   "(e.g. nocache=--disable-radix-cache)")  # fmt: skip
    p.add_argument("--cold-start", action="store_true",
                   help="give each launched `pdserve up` an empty PDSERVE_CACHE_DIR (removed at the end), "
                   "so that its start is a first start: no quantized-weights cache")  # fmt: skip
    p.add_argument("--launch-transformers-serve", action="store_true", help="start `transformers serve` too")
    # Unbounded, transformers' continuous batching sizes its KV cache to ~90% of free memory (host RAM
    # on CPU); these bound it to 32768 tokens (128 blocks of 256) and its batches to pdserve's chunked
    # prefill (2048).
    p.add_argument("--transformers-args", default="--cb-num-blocks 128 --cb-max-batch-tokens 2048",
                   help="extra flags for the launched transformers serve (default: %(default)s)")  # fmt: skip
    p.add_argument("--launch-llama-server", default=None, metavar="PATH",
                   help="start llama.cpp's llama-server binary at PATH on the bundled GGUF as target llama-server")  # fmt: skip
    p.add_argument(
        "--llama-server-model",
        default=None,
        help="the GGUF file llama-server serves (default: the bundled one)",
    )
    # 16 slots of 1024 tokens each (llama-server splits -c among its -np slots), every core for both
    # generation and batches; --no-repack keeps ggml off its AMX repacking path, which crashes on
    # some of the CPUs this was measured on.
    cores = os.cpu_count() or 1
    p.add_argument("--llama-server-args", default=f"-t {cores} -tb {cores} -np 16 -c 16384 --no-repack",
                   help="extra flags for the launched llama-server (default: %(default)s)")  # fmt: skip
    p.add_argument("--launch-port", type=int, default=33100,
                   help="pdserve's port; transformers gets +10, llama-server +12")  # fmt: skip
    p.add_argument("--launch-timeout", type=float, default=600.0,
                   help="seconds each launched server may take to become healthy")  # fmt: skip
    p.add_argument("--launch-log-dir", default=None)
