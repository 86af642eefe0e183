"""The GPU check's stages for the C++ CPU kernels (kernels/*.cpp), run on the GPU host's CPU.

  cpu_kernels        their tests, built for the host's own instruction set
  cpu_kernels_avx2   the same with PDSERVE_CPU_ISA=avx2 (the AVX2 forms, built with -march=x86-64-v3);
                     skipped on a host without AVX-512, whose own build is that one

The tests run in a process of their own under pytest-xdist with the fault handler on, so a kernel that
crashes ends one worker (its Python stack in the log) and the stage names each test that did, rather
than losing the whole GPU check. Dry run (`--dry-run`): the tests are collected only (which builds the
library: a test module asks what it supports).
"""

from __future__ import annotations

import re
import signal
import sys

from pdserve.bench.gpu_run import ROOT, Run, StageResult

# Not torch here: a child applies the cap (PDSERVE_CPU_ISA) to torch's own kernels before torch loads.
from pdserve.kernels import cpu_isa

ISA_TESTS = "tests/kernels/test_isa_cap.py"
# The cap's test that reruns every kernel test under avx2: cpu_kernels_avx2 is that run.
AVX2_RERUN = f"{ISA_TESTS}::test_the_avx2_kernels_pass_on_this_avx512_host"
WORKERS = 8


def cpp_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "kernels").glob("test_cpu_*.py"))


def stage_cpu_kernels(run: Run, isa: str | None = None) -> StageResult:
    name = f"cpu_kernels_{isa}" if isa else "cpu_kernels"
    if isa == "avx2" and "avx512f" not in cpu_isa.host_flags():
        return StageResult(
            name, "skipped", 0.0, "no AVX-512 here: cpu_kernels built and tested the AVX2 forms"
        )
    env = {"PYTHONFAULTHANDLER": "1", **({cpu_isa.ISA_ENV: isa} if isa else {})}
    tests, crashed = _run_tests(run, name, env)
    detail = f"tests: {tests}" + (f" ({len(crashed)} crashed the process)" if crashed else "")
    bad = tests.startswith("rc ") or "failed" in tests or "error" in tests or bool(crashed)
    return StageResult(name, "failed" if bad else "ok", 0.0, detail, {"tests": tests, "crashed": crashed})


def _run_tests(run: Run, name: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """The kernels' tests in their own process: (pytest's summary line, the tests that crashed a worker)."""
    argv = [sys.executable, "-X", "faulthandler", "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += [*cpp_test_files(), ISA_TESTS, "--deselect", AVX2_RERUN]
    if run.dry_run:
        argv += ["--collect-only"]
    else:
        argv += ["-n", str(WORKERS)]
    rc, tail = run.cmd(name, argv, 180 if cpu_isa.ISA_ENV in env else 150, env)  # the cap builds anew
    crashed = crashed_tests((run.logs / f"{name}.log").read_text())
    lines = [line.strip("= ") for line in tail.strip().splitlines() if line.strip()]
    summary = lines[-1][:160] if lines else "no output"
    if rc < 0:
        summary = f"rc {rc} ({signal_name(-rc)}) after: {summary}"
    elif rc not in (0, 1):
        summary = f"rc {rc}: {summary}"
    return summary, crashed


def crashed_tests(log: str) -> list[str]:
    """The tests whose xdist worker died, as pytest-xdist names them."""
    return sorted(set(re.findall(r"worker '\w+' crashed while running '([^']+)'", log)))


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
