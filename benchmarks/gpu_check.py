"""`pdserve bench gpu`: one prepared run that builds, checks and times pdserve on one GPU.

    pdserve bench gpu --out DIR [--model-path GGUF_OR_FOLDER | --random-weights-like FOLDER] [--budget-s 480]
    pdserve bench gpu --dry-run --out DIR      # on a CPU machine: everything that needs no CUDA

Stages, in order, each with its own log under DIR/logs and a line in DIR/summary.json:
  env         the device, torch, triton, CUDA, the CPU and which CPU kernel paths its instructions take
  model       with --random-weights-like: a checkpoint of that folder's config and tokenizer with random
              weights, which the later stages serve (the summary names the weights each used)
  wheels      (dry run) every package pdserve needs is on the GPU image or in benchmarks/gpu_wheels.txt
  packaging   pdserve builds as a wheel offline and the wheel holds every package and kernel
  kernel_tests  tests/kernels on CUDA, compiled, but the C++ CPU kernels' tests (the next two stages),
              and the CUDA KV pool's hand-off over gloo (on CPU: the GPU tests collected only)
  kernel_bench  `pdserve bench kernels`: each kernel's bandwidth against the device copy, the KV
              hand-off's page gather and scatter among them
  cpu_kernels   the C++ CPU kernels' tests on the host's CPU in a process of their own, naming each
              test that crashed its process (benchmarks/gpu_cpu_kernels.py)
  cpu_kernels_avx2  the same tests with PDSERVE_CPU_ISA=avx2: the kernels' AVX2 forms
  parity      engine vs transformers in bf16 on the device: logits and greedy output, for tiny random
              Llama/Qwen2/Qwen3 checkpoints and the served model
  profiles    what a capacity planner reads: prefill time per prompt length, decode step time per batch
              size and context (profiles.json)
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
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.gpu_cluster import stage_cluster
from pdserve.bench.gpu_cpu_kernels import ISA_TESTS, cpp_test_files, stage_cpu_kernels
from pdserve.bench.gpu_install import stage_packaging, stage_wheels
from pdserve.bench.gpu_run import ROOT, Run, StageResult, cli_args
from pdserve.launch.supervisor import pdserve_command

CUDA_KV_POOL_TEST = (
    "tests/kv_transfer/test_engine.py::test_cuda_pools_over_gloo_are_staged_through_host_memory"
)

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
    from pdserve.runtime.host import cpu_has_amx, cpu_has_bf16, cpu_has_int8_dot

    # Without these instructions the C++ CPU kernels take their fallback paths (kernel_tests runs them).
    numbers["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
    numbers["cpu_bf16"], numbers["cpu_amx"], numbers["cpu_int8_dot"] = (
        cpu_has_bf16(), cpu_has_amx(), cpu_has_int8_dot()
    )  # fmt: skip
    try:
        import triton

        numbers["triton"] = triton.__version__
    except ImportError:
        numbers["triton"] = "missing"
    if run.cuda:
        free, total = torch.cuda.mem_get_info()
        numbers["gpu_memory_gib"] = round(total / 2**30, 1)
        numbers["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    detail = f"{numbers['device']}, torch {numbers['torch']}, triton {numbers['triton']}, {numbers['cpu']} ({numbers['cpu_isa']})"
    return StageResult("env", "ok", 0.0, detail, numbers)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def stage_kernel_tests(run: Run) -> StageResult:
    if run.cuda:
        env = {"TRITON_INTERPRET": "0"}
        tests = ["tests/kernels", CUDA_KV_POOL_TEST]
        argv = [sys.executable, "-P", "-m", "pytest", "-q", "-n", "12", "-p", "no:cacheprovider", *tests]
        # The C++ CPU kernels' tests run in the cpu_kernels stages, in processes of their own.
        argv += [f"--ignore={path}" for path in (*cpp_test_files(), ISA_TESTS)]
        rc, tail = run.cmd("kernel_tests", argv, 100, env)
    else:  # the GPU-only tests must at least still be collected
        rc, tail = run.cmd(
            "kernel_tests",
            [
                sys.executable,
                "-P",
                "-m",
                "pytest",
                "-q",
                "--collect-only",
                "-m",
                "gpu",
                "tests/kernels",
                CUDA_KV_POOL_TEST,
            ],
            120,
        )
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    return StageResult("kernel_tests", "ok" if rc == 0 else "failed", 0.0, summary)


def stage_kernel_bench(run: Run) -> StageResult:
    rc, _ = run.cmd("kernel_bench", pdserve_command("bench", "kernels"), 120)
    log = (run.logs / "kernel_bench.log").read_text()
    verdicts = re.findall(r"(WRONG|MISSED)", log)
    status = "ok" if rc == 0 and "WRONG" not in verdicts else "failed"
    # each missed target's kernel, problem and share of the copy bandwidth (the table's columns)
    missed = [
        f"{line[:19].strip()} {line[20:62].strip()}: {line[63:].split()[3]} of copy"
        for line in log.splitlines()
        if line.endswith("MISSED")
    ]
    note = "" if run.cuda else " (no CUDA: the interpreted smoke check only)"
    detail = f"targets missed: {len(missed)}{note}" + (f" ({'; '.join(missed)})" if missed else "")
    return StageResult("kernel_bench", status, 0.0, detail, {"missed": missed})


def stage_parity(run: Run, model_path: str | None, label: str) -> StageResult:
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
        results.append(check_parity(bundled, device, dtype, model_name=label).as_dict())
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
        return StageResult("engine_bench", "skipped", 0.0, "needs CUDA: " + shlex.join(cli_args(argv)))
    rc, tail = run.cmd("engine_bench", argv, 90)
    return StageResult(
        "engine_bench", "ok" if rc == 0 else "failed", 0.0, tail.strip().splitlines()[-1][:200]
    )


def stage_tp(run: Run, model_path: str | None) -> StageResult | None:
    """TP 2 against TP 1 (`pdserve bench tp`): NCCL between two GPUs, so it needs two of them."""
    argv = pdserve_command("bench", "tp", "--device", "cuda", "--dtype", "bfloat16", "--tp", "2")
    argv += ["--lengths", "512", "2048", "--batches", "1", "16", "64"]
    argv += ["--model-path", model_path] if model_path else []
    import torch

    gpus = torch.cuda.device_count() if run.cuda else 0
    if gpus < 2:
        return StageResult("tp", "skipped", 0.0, f"needs 2 GPUs, {gpus} here: " + shlex.join(cli_args(argv)))
    rc, tail = run.cmd("tp", argv, 240)
    return StageResult("tp", "ok" if rc == 0 else "failed", 0.0, tail.strip().splitlines()[-1][:200])


def stage_model(run: Run, like: str | None, served: dict) -> StageResult:
    """With `like`: write a random-weight checkpoint of its shape and serve it in the later stages."""
    if not like:
        return StageResult("model", "skipped", 0.0, f"serving {served['label']}")
    from pdserve.bench.tiny_models import write_shaped_checkpoint

    folder = write_shaped_checkpoint(like, tempfile.mkdtemp(prefix="pdserve-shaped-"))
    config = json.loads((Path(folder) / "config.json").read_text())
    name = config.get("_model_name_or_path") or config.get("model_type", "model")
    served.update(path=folder, label=f"random weights shaped like {name}")
    return StageResult("model", "ok", 0.0, served["label"], {"config": config})


def stage_profiles(run: Run, model_path: str | None, label: str) -> StageResult:
    """Prefill and decode-step times for the planner (profiles.json); on CPU a small tiny-model smoke."""
    from pdserve.bench.gpu_profiles import measure_profiles

    if run.cuda:
        folder = model_path or _bundled_model()
        if folder is None:
            return StageResult("profiles", "skipped", 0.0, "no model here (pass --model-path)")
        profiles = measure_profiles(folder, "cuda", "bfloat16")
    else:
        from pdserve.bench.tiny_models import write_tiny_checkpoint

        label = "llama-untied (tiny, random)"
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_tiny_checkpoint("llama-untied", tmp)
            profiles = measure_profiles(folder, "cpu", "float32", (16, 64), (1, 4), (32,), repeats=1)
    profiles["weights"] = label
    (run.out / "profiles.json").write_text(json.dumps(profiles, indent=1))
    pre, dec = profiles["prefill_ms"], profiles["decode_step_ms"]
    detail = f"prefill ms {pre}; decode step ms {dec}"
    return StageResult("profiles", "ok", 0.0, detail, profiles)


# ---- the run ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("pdserve bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for summary.json, summary.txt and logs/")
    ap.add_argument("--dry-run", action="store_true", help="on a CPU machine: every stage that needs no CUDA")
    ap.add_argument(
        "--model-path", default=None, help="the bundled model's GGUF (or another checkpoint) there"
    )
    ap.add_argument(
        "--random-weights-like",
        default=None,
        help="a model folder: serve a random-weight checkpoint of its config and tokenizer instead",
    )
    ap.add_argument("--budget-s", type=float, default=480.0, help="no stage starts after this many seconds")
    ap.add_argument("--skip", default="", help="comma-separated stage names to leave out")
    args = ap.parse_args(argv)
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "tests" / "kernels").is_dir():
        ap.error("run it from the root of a pdserve checkout (it reads tests/ and benchmarks/ there)")
    run = Run(Path(args.out), args.dry_run, args.budget_s)
    if run.cuda and args.dry_run:
        print("note: --dry-run on a CUDA machine still runs the CUDA stages")
    # What the model-serving stages serve; the model stage may replace it with random weights.
    served = {"path": args.model_path, "label": args.model_path or "the bundled model"}
    stages: list[tuple[str, Callable[[Run], StageResult | None]]] = [
        ("env", stage_env),
        ("model", lambda r: stage_model(r, args.random_weights_like, served)),
        ("wheels", stage_wheels),
        ("packaging", stage_packaging),
        ("kernel_tests", stage_kernel_tests),
        ("kernel_bench", stage_kernel_bench),
        ("cpu_kernels", stage_cpu_kernels),
        ("cpu_kernels_avx2", lambda r: stage_cpu_kernels(r, "avx2")),
        ("parity", lambda r: stage_parity(r, served["path"], served["label"])),
        ("profiles", lambda r: stage_profiles(r, served["path"], served["label"])),
        ("engine_bench", lambda r: stage_engine_bench(r, served["path"])),
        ("tp", lambda r: stage_tp(r, served["path"])),
        ("cluster", lambda r: stage_cluster(r, served["path"])),
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
    lines = [f"{r.name:<16} {r.status:<7} {r.seconds:7.1f} s  {r.detail}" for r in run.results]
    (run.out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 1 if any(r.status == "failed" for r in run.results) else 0


if __name__ == "__main__":
    sys.exit(main())
