"""`pdserve bench gpu`: one prepared run that builds, checks and times pdserve on one GPU.

    pdserve bench gpu --out DIR [--model-path GGUF_OR_FOLDER] [--budget-s 480]
    pdserve bench gpu --dry-run --out DIR      # on a CPU machine: everything that needs no CUDA

Stages, in order, each with its own log under DIR/logs and a line in DIR/summary.json:
  env         the device, torch, triton, CUDA and the CPU
  wheels      (dry run) every package pdserve needs is on the GPU image or in benchmarks/gpu_wheels.txt
  packaging   pdserve builds as a wheel offline and the wheel holds every package and kernel
  kernel_tests  tests/kernels on CUDA, compiled (on CPU: collected only)
  kernel_bench  `pdserve bench kernels`: each kernel's bandwidth against the device copy
  parity      engine vs transformers in bf16 on the device: logits and greedy output, for tiny random
              Llama/Qwen2/Qwen3 checkpoints and the bundled model when its file is there
  engine_bench  `pdserve bench engine` in bf16 at batch 1, 16, 64
  cluster     `pdserve up` on the one GPU (prefill and decode as separate processes) and
              `pdserve bench serving` at concurrency 64: zero errors expected
A stage that cannot run here says why (skipped); a failed stage does not stop the later ones, and
the run stops starting new stages once `--budget-s` is spent. Exit status 1 if any stage failed.

The KV hand-off between two processes on one GPU: NCCL cannot pair two ranks on the same device, so
the cluster stage runs the gloo backend, which stages the CUDA pool's pages through pinned host
memory (`--kv-transfer-backend gloo`); the summary names the path.

On the GPU machine, `benchmarks/gpu_check.sh` installs the wheels carried in `.gpu/wheels` and
pdserve itself (no index is reachable there) and runs this; `make gpu-bundle` prepares `.gpu/`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.launch.supervisor import pdserve_command

# Run from a checkout's root (the tests, the lists and the sources are read from there); pdserve itself
# may be installed elsewhere, as on the GPU machine.
ROOT = Path.cwd()
WHEELS_FILE = ROOT / "benchmarks" / "gpu_wheels.txt"
IMAGE_FILE = ROOT / "benchmarks" / "gpu_image.txt"
PACKAGES = [
    "protocol", "runtime", "runtime/models", "runtime/grammar", "kernels", "kv_transfer", "prefill", "decode",
    "gateway", "gateway/function_call", "bench",
]  # fmt: skip


@dataclass
class StageResult:
    name: str
    status: str  # ok | failed | skipped
    seconds: float
    detail: str = ""
    numbers: dict = field(default_factory=dict)


class Run:
    """The output folder, the clock and the stages' results."""

    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.dry_run, self.budget_s = out, dry_run, budget_s
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.results: list[StageResult] = []
        self.cuda = _cuda_available()

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def cmd(self, name: str, argv: list[str], timeout_s: float, env: dict | None = None) -> tuple[int, str]:
        """Run `argv` (cwd: the repo) with its output in logs/<name>.log; (exit status, output tail)."""
        log = self.logs / f"{name}.log"
        timeout_s = max(10.0, min(timeout_s, self.left_s()))
        with open(log, "w") as f:
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            try:
                p = subprocess.run(
                    argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                    env={**os.environ, **(env or {})},
                )  # fmt: skip
                rc = p.returncode
            except subprocess.TimeoutExpired:
                f.write(f"\n[timed out after {timeout_s:.0f} s]\n")
                rc = 124
        return rc, log.read_text()[-2000:]

    def stage(self, name: str, fn: Callable[[Run], StageResult | None]) -> None:
        t = time.monotonic()
        if self.left_s() <= 0:
            result = StageResult(name, "skipped", 0.0, "the time budget was spent")
        else:
            try:
                result = fn(self) or StageResult(name, "ok", 0.0)
            except Exception as e:  # noqa: BLE001 - a broken stage is reported, the next one runs
                result = StageResult(name, "failed", 0.0, f"{type(e).__name__}: {e}")
        result.name, result.seconds = name, round(time.monotonic() - t, 2)
        self.results.append(result)
        print(f"[{result.seconds:7.1f} s] {name:<13} {result.status:<7} {result.detail}", flush=True)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ---- stages -------------------------------------------------------------------------------------------


def stage_env(run: Run) -> StageResult:
    import torch

    numbers: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if run.cuda else "none",
    }
    try:
        import triton

        numbers["triton"] = triton.__version__
    except ImportError:
        numbers["triton"] = "missing"
    if run.cuda:
        free, total = torch.cuda.mem_get_info()
        numbers["gpu_memory_gib"] = round(total / 2**30, 1)
        numbers["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    detail = f"{numbers['device']}, torch {numbers['torch']}, triton {numbers['triton']}, {numbers['cpu']}"
    return StageResult("env", "ok", 0.0, detail, numbers)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(path: Path) -> dict[str, str]:
    """name -> version ('' when not pinned) of a list file: names (`name==version`) separated by
    white space, `#` comments."""
    out = {}
    for line in path.read_text().splitlines():
        for item in line.split("#", 1)[0].split():
            name, _, version = item.partition("==")
            out[_norm(name)] = version
    return out


def missing_on_gpu() -> tuple[list[str], list[str]]:
    """(packages pdserve needs, recursively, that neither the GPU image nor the wheel list has;
    wheel-list entries whose pinned version differs from what this environment runs)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    image, wheels = _listed(IMAGE_FILE), _listed(WHEELS_FILE)
    seen: set[str] = set()
    missing, stale = [], []
    todo = [r for r in md.requires("pdserve") or [] if "extra ==" not in r]
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen or name in image:
            continue
        seen.add(name)
        if name not in wheels:
            missing.append(name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        if name in wheels and wheels[name] and wheels[name] != dist.version:
            stale.append(f"{name} {wheels[name]} (here {dist.version})")
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return sorted(missing), sorted(stale)


def stage_wheels(run: Run) -> StageResult:
    if not run.dry_run:
        wheels = sorted(p.name for p in (ROOT / ".gpu" / "wheels").glob("*.whl"))
        return StageResult("wheels", "ok", 0.0, f"{len(wheels)} wheels carried", {"wheels": wheels})
    missing, stale = missing_on_gpu()
    numbers = {"missing": missing, "stale": stale, "listed": sorted(_listed(WHEELS_FILE))}
    if missing or stale:
        why = f"not on the GPU image nor in {WHEELS_FILE.name}: {missing}; other versions: {stale}"
        return StageResult("wheels", "failed", 0.0, why, numbers)
    return StageResult(
        "wheels", "ok", 0.0, f"{len(numbers['listed'])} wheels cover what the image lacks", numbers
    )


def stage_packaging(run: Run) -> StageResult:
    """Build pdserve's wheel offline (what gpu_check.sh installs there) and look inside."""
    with tempfile.TemporaryDirectory() as tmp:
        rc, tail = run.cmd(
            "packaging",
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
             "-q", "-w", tmp, str(ROOT)],
            300,
        )  # fmt: skip
        if rc != 0:
            return StageResult("packaging", "failed", 0.0, f"pip wheel failed: {tail[-300:]}")
        (wheel,) = Path(tmp).glob("pdserve-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
    want = ["pdserve/cli.py", "pdserve/protocol/codec.py", "pdserve/bench/gpu_check.py"]
    want += [f"pdserve/{p}/__init__.py" for p in PACKAGES]
    want += [f"pdserve/kernels/{k.name}" for k in (ROOT / "kernels").glob("*.py")]
    absent = [w for w in want if w not in names]
    if absent:
        return StageResult("packaging", "failed", 0.0, f"the wheel lacks {absent}")
    return StageResult("packaging", "ok", 0.0, f"{wheel.name}: {len(names)} files", {"files": len(names)})


def stage_kernel_tests(run: Run) -> StageResult:
    if run.cuda:
        env = {"TRITON_INTERPRET": "0"}
        rc, tail = run.cmd(
            "kernel_tests", [sys.executable, "-P", "-m", "pytest", "-q", "tests/kernels"], 300, env
        )
    else:  # the GPU-only tests must at least still be collected
        rc, tail = run.cmd(
            "kernel_tests",
            [sys.executable, "-P", "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "tests/kernels"],
            120,
        )
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    return StageResult("kernel_tests", "ok" if rc == 0 else "failed", 0.0, summary)


def stage_kernel_bench(run: Run) -> StageResult:
    rc, tail = run.cmd("kernel_bench", pdserve_command("bench", "kernels"), 240)
    verdicts = re.findall(r"(WRONG|MISSED)", tail)
    status = "ok" if rc == 0 and "WRONG" not in verdicts else "failed"
    note = "" if run.cuda else " (no CUDA: the interpreted smoke check only)"
    return StageResult("kernel_bench", status, 0.0, f"targets missed: {verdicts.count('MISSED')}{note}")


def stage_parity(run: Run, model_path: str | None) -> StageResult:
    from pdserve.bench.gpu_parity import check_parity
    from pdserve.bench.tiny_models import TINY_CONFIGS, write_tiny_checkpoint

    device, dtype = ("cuda", "bfloat16") if run.cuda else ("cpu", "float32")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(TINY_CONFIGS):
            folder = write_tiny_checkpoint(name, os.path.join(tmp, name), seed=i)
            results.append(check_parity(folder, device, dtype, model_name=name).as_dict())
    bundled = model_path or (None if run.dry_run else _bundled_model())
    if bundled:
        results.append(check_parity(bundled, device, dtype, model_name="bundled").as_dict())
    (run.out / "parity.json").write_text(json.dumps(results, indent=1))
    bad = [r["model"] for r in results if not r["ok"]]
    worst = max(r["logits_rel_diff"] for r in results)
    detail = f"{len(results)} models on {device} {dtype}; worst logits rel diff {worst:.2e}"
    detail += "" if bundled else "; bundled model not here (pass --model-path)"
    if bad:
        return StageResult(
            "parity", "failed", 0.0, f"greedy mismatches on {bad}; {detail}", {"models": results}
        )
    return StageResult("parity", "ok", 0.0, detail, {"models": results})


def _bundled_model() -> str | None:
    from pdserve.model_source import resolve_model_source

    try:
        return resolve_model_source(None).gguf_path
    except Exception:  # noqa: BLE001 - not installed there: the stage says so
        return None


def stage_engine_bench(run: Run, model_path: str | None) -> StageResult | None:
    argv = pdserve_command(
        "bench", "engine", "--device", "cuda", "--dtype", "bfloat16", "--batch-sizes", "1,16,64"
    )
    argv += ["--model-path", model_path] if model_path else []
    if not run.cuda:
        return StageResult("engine_bench", "skipped", 0.0, "needs CUDA: " + shlex.join(_cli_args(argv)))
    rc, tail = run.cmd("engine_bench", argv, 300)
    return StageResult(
        "engine_bench", "ok" if rc == 0 else "failed", 0.0, tail.strip().splitlines()[-1][:200]
    )


def cluster_commands(port: int, model_path: str | None, log_dir: str) -> tuple[list[str], list[str]]:
    """`pdserve up` on the one GPU and the serving benchmark against it."""
    up = pdserve_command("up", "--device", "cuda", "--port", str(port), "--log-dir", log_dir)
    up += ["--model-path", model_path] if model_path else []
    # Two processes share the device: each gets a KV pool of its own, staged hand-off through the host.
    up += ["--", "--kv-transfer-backend", "gloo", "--mem-fraction-static", "0.3"]
    bench = pdserve_command(
        "bench", "serving", "--base-url", f"http://127.0.0.1:{port}", "--max-concurrency", "64"
    )
    bench += ["--num-prompts", "256", "--dataset", "random", "--random-input-len", "512"]
    bench += [
        "--random-output-len",
        "128",
        "--ignore-eos",
        "--output-json",
        os.path.join(log_dir, "serving.json"),
    ]
    return up, bench


def stage_cluster(run: Run, model_path: str | None) -> StageResult:
    up, bench = cluster_commands(31900, model_path, str(run.logs / "cluster"))
    if not run.cuda:
        _parse_only(up, bench)
        return StageResult(
            "cluster", "skipped", 0.0, "needs CUDA (command lines parsed): " + shlex.join(_cli_args(up))
        )
    import httpx

    (run.logs / "cluster").mkdir(exist_ok=True)
    log = open(run.logs / "cluster_up.log", "w")
    server = subprocess.Popen(up, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + min(240.0, run.left_s())
        while time.monotonic() < deadline:
            if server.poll() is not None:
                return StageResult("cluster", "failed", 0.0, f"pdserve up exited with {server.returncode}")
            try:
                if httpx.get("http://127.0.0.1:31900/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            return StageResult("cluster", "failed", 0.0, "not healthy within 240 s")
        rc, tail = run.cmd("cluster_bench", bench, 300)
        numbers: dict = {"kv_path": "gloo, staged through pinned host memory"}
        try:
            metrics = json.loads((run.logs / "cluster" / "serving.json").read_text())["runs"][0]["metrics"]
            numbers.update({k: metrics[k] for k in ("completed", "failed", "output_throughput")})
        except (OSError, ValueError, KeyError, IndexError):
            pass
        detail = f"kv path: {numbers['kv_path']}; {numbers.get('completed', '?')} completed, "
        detail += (
            f"{numbers.get('failed', '?')} failed, {numbers.get('output_throughput', 0):.0f} output tok/s"
        )
        return StageResult("cluster", "ok" if rc == 0 else "failed", 0.0, detail, numbers)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
        log.close()


def _parse_only(up: list[str], bench: list[str]) -> None:
    """The command lines are accepted by pdserve's own parsers (flags renamed elsewhere fail here)."""
    from pdserve.bench import bench_serving
    from pdserve.launch import up as launcher

    parser = argparse.ArgumentParser()
    launcher.add_cli_args(parser)
    _, rest = parser.parse_known_args(_cli_args(up)[1:])  # after "up"
    if rest and rest[0] != "--":
        raise ValueError(f"pdserve up does not take {rest}")
    bench_serving.parse_args(_cli_args(bench)[2:])  # after "bench serving"


def _cli_args(argv: list[str]) -> list[str]:
    """A pdserve command line from `pdserve.cli` on: what follows the interpreter and its options."""
    return argv[argv.index("pdserve.cli") + 1 :]


# ---- the run ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("pdserve bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for summary.json, summary.txt and logs/")
    ap.add_argument("--dry-run", action="store_true", help="on a CPU machine: every stage that needs no CUDA")
    ap.add_argument(
        "--model-path", default=None, help="the bundled model's GGUF (or another checkpoint) there"
    )
    ap.add_argument("--budget-s", type=float, default=480.0, help="no stage starts after this many seconds")
    ap.add_argument("--skip", default="", help="comma-separated stage names to leave out")
    args = ap.parse_args(argv)
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "tests" / "kernels").is_dir():
        ap.error("run it from the root of a pdserve checkout (it reads tests/ and benchmarks/ there)")
    run = Run(Path(args.out), args.dry_run, args.budget_s)
    if run.cuda and args.dry_run:
        print("note: --dry-run on a CUDA machine still runs the CUDA stages")
    stages: list[tuple[str, Callable[[Run], StageResult | None]]] = [
        ("env", stage_env),
        ("wheels", stage_wheels),
        ("packaging", stage_packaging),
        ("kernel_tests", stage_kernel_tests),
        ("kernel_bench", stage_kernel_bench),
        ("parity", lambda r: stage_parity(r, args.model_path)),
        ("engine_bench", lambda r: stage_engine_bench(r, args.model_path)),
        ("cluster", lambda r: stage_cluster(r, args.model_path)),
    ]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    for name, fn in stages:
        if name in skip:
            run.results.append(StageResult(name, "skipped", 0.0, "--skip"))
            continue
        run.stage(name, fn)
    summary = {
        "dry_run": args.dry_run,
        "seconds": round(time.monotonic() - run.t0, 1),
        "stages": [asdict(r) for r in run.results],
    }
    (run.out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"{r.name:<13} {r.status:<7} {r.seconds:7.1f} s  {r.detail}" for r in run.results]
    (run.out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 1 if any(r.status == "failed" for r in run.results) else 0


if __name__ == "__main__":
    sys.exit(main())
