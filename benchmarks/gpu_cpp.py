"""The GPU check's stages for the C++ CPU kernels (kernels/*.cpp), run on the GPU host's CPU.

The H200 run of 2026-12-04 lost its test process to a segmentation fault at each of the kernels' checks
whose message formats numbers (`TORCH_CHECK(ok, "lens[", b, "] = ", ...)`), while checks with a fixed
message raised their errors. These stages test the kernels and gather, in the same run, what tells the
likely causes apart:

  cpu_kernels        the library built for the host's own instruction set
  cpu_kernels_avx2   the same with PDSERVE_CPU_ISA=avx2 (the AVX2 forms, built with -march=x86-64-v3);
                     skipped on a host without AVX-512, whose own build is that one

Each stage, with its logs under logs/<stage>*.log:
  tests     tests/kernels/test_cpu_*.py and the cap's tests, `python -X faulthandler` under pytest-xdist:
            a crash ends one worker (its Python stack in the log), the run goes on and names each test
            that crashed
  facts     `c++ --version`, torch's C++ ABI (`torch._C._GLIBCXX_USE_CXX11_ABI`,
            `torch.compiled_with_cxx11_abi()`) and its own compiler and flags, the flags cpu_library
            builds with and the compile and link lines of the build itself (build.ninja), the C++
            runtime libraries the library links and the process has mapped, the kernel, glibc and
            the thread's x86 features (shadow stacks)
  triggers  one check of each kind, each in a fresh process that loads the library and calls one
            operator: a fixed message (`literal`), a fixed message with tensors alive in the frame
            (`literal_locals`), a formatted message of strings only (`strings`), a formatted message
            with numbers (`number`; `number_locals` with tensors alive: the failing test's own check;
            `number_after_kernels` the same after the kernels and torch's bf16 matmul have run)
  repro     (cpu_kernels) a tiny extension with six checks (the four kinds, and a fixed and a formatted
            message in a frame that realigns its stack for 64-byte data, as the library's operators
            do), each called in a forked child, built five ways: with the library's flags, with one
            of -ffast-math, the instruction-set flags or -fopenmp left out, and with none: which
            flag, if any, the crash follows
  debugger  (cpu_kernels) `gdb -batch -ex run -ex bt` (cuda-gdb where the host has no gdb, as the GPU
            image has not) on the first trigger that crashed, else on the first test file that did;
            with the signal's si_code and address, the faulting instructions and the libraries mapped
Dry run (`--dry-run`): the tests are collected only, repro builds the library's flags only, no debugger.

The children run as `python -P -m pdserve.bench.gpu_cpp facts | trigger NAME | repro VARIANT FOLDER`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdserve.bench.gpu_run import ROOT, Run, StageResult

# Not torch here: a child applies the cap (PDSERVE_CPU_ISA) to torch's own kernels before torch loads.
from pdserve.kernels import cpu_isa

ISA_TESTS = "tests/kernels/test_isa_cap.py"
# The cap's test that reruns every kernel test under avx2: cpu_kernels_avx2 is that run.
AVX2_RERUN = f"{ISA_TESTS}::test_the_avx2_kernels_pass_on_this_avx512_host"
TRIGGERS = ("literal", "literal_locals", "strings", "number", "number_locals", "number_after_kernels")
REPRO_CHECKS = ("literal", "literal_locals", "strings", "number", "literal_realigned", "number_realigned")
VARIANTS = ("library", "no-fast-math", "no-isa-flags", "no-openmp", "plain")
WORKERS = 8


def cpp_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "kernels").glob("test_cpu_*.py"))


# ---- the stages ---------------------------------------------------------------------------------------


def stage_cpu_kernels(run: Run, isa: str | None = None) -> StageResult:
    name = f"cpu_kernels_{isa}" if isa else "cpu_kernels"
    if isa == "avx2" and "avx512f" not in cpu_isa.host_flags():
        return StageResult(
            name, "skipped", 0.0, "no AVX-512 here: cpu_kernels built and tested the AVX2 forms"
        )
    env = {"PYTHONFAULTHANDLER": "1", **({cpu_isa.ISA_ENV: isa} if isa else {})}
    tests, crashed = _run_tests(run, name, env)
    jobs = {
        f"{name}_facts": _child("facts"),
        **{f"{name}_trigger_{t}": _child("trigger", t) for t in TRIGGERS},
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-cpp-repro-") as folder:
        for variant in [] if isa else VARIANTS[:1] if run.dry_run else VARIANTS:
            jobs[f"{name}_repro_{variant}"] = _child("repro", variant, os.path.join(folder, variant))
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {job: pool.submit(run.cmd, job, argv, 120, env) for job, argv in jobs.items()}
            # (exit status, the whole log): a FACTS line outgrows the tail that run.cmd returns
            done = {job: (f.result()[0], (run.logs / f"{job}.log").read_text()) for job, f in futures.items()}
    facts = _facts(done.pop(f"{name}_facts"))
    triggers = {t: _outcome(*done[f"{name}_trigger_{t}"]) for t in TRIGGERS}
    repro = {job.rsplit("_", 1)[1]: _repro_outcome(*r) for job, r in done.items() if "_repro_" in job}
    numbers = {"tests": tests, "crashed": crashed, "triggers": triggers, "repro": repro, "facts": facts}
    detail = f"tests: {tests}" + (f" ({len(crashed)} crashed the process)" if crashed else "")
    detail += "; triggers: " + ", ".join(f"{t} {o}" for t, o in triggers.items())
    if repro:
        detail += "; repro: " + ", ".join(f"{v} {o}" for v, o in repro.items())
    if not isa and not run.dry_run:
        numbers["debugger"] = _debugger_run(run, name, env, triggers, crashed)
        detail += f"; debugger: {numbers['debugger']}"
    detail += f"; {facts.get('cxx', '?')}, torch cxx11 ABI {facts.get('torch_cxx11_abi', '?')}"
    bad = tests.startswith("rc ") or "failed" in tests or "error" in tests or bool(crashed)
    bad = bad or any(o != "raised" for o in triggers.values())
    # The repro extension raises its checks through TORCH_CHECK's own number formatting on purpose: it
    # describes the host's toolchain (it crashed on the H200 host, whose g++ links its own C++ library
    # into extensions), while pdserve's kernels build their messages from strings (PDSERVE_CHECK). So
    # it is reported, not counted against the stage.
    return StageResult(name, "failed" if bad else "ok", 0.0, detail, numbers)


def _run_tests(run: Run, name: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """The kernels' tests in their own process: (pytest's summary line, the tests that crashed a worker)."""
    argv = [sys.executable, "-X", "faulthandler", "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += [*cpp_test_files(), ISA_TESTS, "--deselect", AVX2_RERUN]
    if run.dry_run:  # collected only (which builds the library: a test module asks what it supports)
        argv += ["--collect-only"]
    else:
        argv += ["-n", str(WORKERS)]
    rc, tail = run.cmd(name, argv, 180 if cpu_isa.ISA_ENV in env else 150, env)  # the cap builds anew
    crashed = crashed_tests((run.logs / f"{name}.log").read_text())
    lines = [line.strip("= ") for line in tail.strip().splitlines() if line.strip()]
    summary = lines[-1][:160] if lines else "no output"
    if rc < 0:
        summary = f"rc {rc} ({_signal_name(-rc)}) after: {summary}"
    elif rc not in (0, 1):
        summary = f"rc {rc}: {summary}"
    return summary, crashed


def crashed_tests(log: str) -> list[str]:
    """The tests whose xdist worker died, as pytest-xdist names them."""
    return sorted(set(re.findall(r"worker '\w+' crashed while running '([^']+)'", log)))


def _child(*args: str) -> list[str]:
    return [sys.executable, "-X", "faulthandler", "-P", "-m", "pdserve.bench.gpu_cpp", *args]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _outcome(rc: int, tail: str) -> str:
    if rc == 0:
        return "raised"
    if rc < 0:
        return f"died of {_signal_name(-rc)}"
    found = re.findall(r"^TRIGGER \w+: (.*)$", tail, re.M)
    return found[-1][:80] if found else f"rc {rc}"


def _repro_outcome(rc: int, tail: str) -> str:
    """'ok' (every check raised its error), else each check that did not and what happened to it."""
    if rc == 0:
        return "ok"
    outcomes = dict(re.findall(r"^OUTCOME (\w+): (.*)$", tail, re.M))
    if rc < 0:
        return f"died of {_signal_name(-rc)}"
    if not outcomes:
        found = re.findall(r"^REPRO: (.*)$", tail, re.M)
        return found[-1][:80] if found else f"rc {rc}"
    return ", ".join(f"{check} {o}" for check, o in outcomes.items() if o != "raised")


def _facts(result: tuple[int, str]) -> dict[str, Any]:
    rc, tail = result
    found = re.findall(r"^FACTS (.*)$", tail, re.M)
    if not found:
        return {"error": f"rc {rc}"}
    facts: dict[str, Any] = json.loads(found[-1])
    return facts


def _debugger() -> str | None:
    for name in ("gdb", "cuda-gdb"):
        if path := shutil.which(name):
            return path
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuda-gdb"
    return str(cuda) if os.access(cuda, os.X_OK) else None


def _debugger_run(
    run: Run, name: str, env: dict[str, str], triggers: dict[str, str], crashed: list[str]
) -> str:
    """A backtrace at the crash: the first trigger that died, else the first crashed test's file."""
    debugger = _debugger()
    if debugger is None:
        return "none here (no gdb, no cuda-gdb)"
    died = [t for t, o in triggers.items() if o.startswith("died")]
    if died:
        target = _child("trigger", died[0])
    elif crashed:
        target = [
            sys.executable,
            "-P",
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
        ]
        target.append(crashed[0].split("::")[0])
    else:
        target = _child("trigger", "number_locals")  # shows it exit cleanly
    argv = [debugger, "-batch", "-nx", "-iex", "set debuginfod enabled off", "-ex", "set pagination off"]
    argv += ["-ex", "handle SIGPIPE SIGUSR1 SIGUSR2 nostop noprint pass", "-ex", "run", "-ex", "bt 60"]
    # si_code tells the faults apart: 1 unmapped address, 2 no access, 128 general protection (a
    # misaligned vector access, say), 10 a shadow stack's control-protection fault.
    argv += ["-ex", "p $_siginfo.si_code", "-ex", "p $_siginfo._sifields._sigfault.si_addr"]
    argv += ["-ex", "info registers rip rsp rbp", "-ex", "x/8i $pc", "-ex", "info sharedlibrary"]
    argv += ["--args", *target]
    rc, tail = run.cmd(f"{name}_gdb", argv, 120, env)
    log = (run.logs / f"{name}_gdb.log").read_text()
    signal_line = re.search(r"^(Thread .* received signal .*|Program received signal .*)$", log, re.M)
    frame = re.search(r"^#0 .*$", log, re.M)
    what = signal_line.group(0)[:100] if signal_line else ("exited" if "exited" in log else f"rc {rc}")
    return f"{Path(debugger).name}: {what}" + (f"; {frame.group(0)[:160]}" if frame else "")


# ---- the children ------------------------------------------------------------------------------------


def _trigger(name: str) -> int:
    """Call one operator with arguments that fail one check; 0 when it raised the expected error."""
    import torch

    from pdserve.kernels import cpu_library, cpu_quant_linear

    if not cpu_library.load():
        print(f"TRIGGER {name}: the library did not build", flush=True)
        return 4
    ops = torch.ops.pdserve_cpu
    q, rows = torch.randn(2, 4, 64), torch.randn(16, 2, 64)
    calls: dict[str, tuple[Callable[[], object], str]]
    key_rows, lens = torch.arange(10).view(2, 5) % 8, torch.tensor([5, 2])
    calls = {
        "literal": (lambda: ops.rms_norm(torch.randn(3, 64), torch.ones(32), 1e-5), r"rms_norm: x \["),
        "literal_locals": (
            lambda: ops.paged_decode_attention(
                q, rows, key_rows, lens, 0, 8, 0.125, torch.randn(2, 2, 32), torch.randn(2, 2, 32)
            ),
            "k_new and v_new must be",
        ),
        "strings": (
            lambda: ops.rms_norm(
                torch.ones(3, 64, dtype=torch.int32), torch.ones(64, dtype=torch.int32), 1e-5
            ),
            "rms_norm: unsupported dtype",
        ),
        "number": (
            lambda: ops.int8_linear(
                torch.zeros(1, 32),
                cpu_quant_linear.pack_int8(torch.zeros(32, 64, dtype=torch.int8)),
                torch.ones(32),
            ),
            "x has 32 inputs, the weights take 64",
        ),
        "number_locals": (
            lambda: ops.paged_decode_attention(
                q, rows, key_rows, torch.tensor([6, 2]), 0, 8, 0.125, None, None
            ),
            r"lens\[0\] = 6 is outside \[0, 5\]",
        ),
    }

    def after_kernels() -> None:
        """The kernels at work first (OpenMP threads, vector state; torch's bf16 matmul, which takes
        AMX where the CPU has it), then number_locals' check, as a test process meets it."""
        ops.paged_decode_attention(q, rows, key_rows, lens, 0, 8, 0.125, None, None)
        bf16 = torch.bfloat16
        ops.rms_norm(torch.randn(64, 576, dtype=bf16), torch.ones(576, dtype=bf16), 1e-5)
        packed = cpu_quant_linear.pack_int8(torch.randint(-8, 8, (64, 256), dtype=torch.int8))
        ops.int8_linear(torch.randn(32, 256), packed, torch.ones(64))
        a = torch.randn(256, 256, dtype=bf16)
        (a @ a).sum().item()
        calls["number_locals"][0]()

    calls["number_after_kernels"] = (after_kernels, calls["number_locals"][1])
    call, expected = calls[name]
    print(f"CALL {name}", flush=True)
    try:
        call()
    except RuntimeError as e:
        message = str(e).splitlines()[0] if str(e) else ""
        if re.search(expected, str(e)):
            print(f"TRIGGER {name}: raised: {message}", flush=True)
            return 0
        print(f"TRIGGER {name}: raised another error: {message}", flush=True)
        return 2
    print(f"TRIGGER {name}: no error", flush=True)
    return 3


_REPRO_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

// Keeps a buffer in memory (the compiler cannot see through it), so that its 64-byte alignment makes
// the function realign its stack, as the library's operators with vector code inlined do.
#define KEEP(p) asm volatile("" : : "r"(p) : "memory")

namespace {
int64_t literal(int64_t x) {
  TORCH_CHECK(x < 0, "a fixed message");
  return x;
}
int64_t literal_locals(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  TORCH_CHECK(c.numel() < 0, "a fixed message with a tensor alive");
  return c.numel();
}
int64_t strings(int64_t x) {
  const char* op = x > 1 ? "op" : "another op";
  TORCH_CHECK(x < 0, op, ": strings only");
  return x;
}
int64_t number(int64_t x) {
  TORCH_CHECK(x < 0, "value ", x, " is outside [", -x, ", 0]");
  return x;
}
int64_t literal_realigned(const at::Tensor& t) {
  alignas(64) float buf[32];
  KEEP(buf);
  at::Tensor c = t.contiguous();
  TORCH_CHECK(c.numel() < 0, "a fixed message in a realigned frame");
  return c.numel() + static_cast<int64_t>(buf[3]);
}
int64_t number_realigned(const at::Tensor& t, int64_t x) {
  alignas(64) float buf[32];
  KEEP(buf);
  at::Tensor c = t.contiguous();
  TORCH_CHECK(x < 0, "value ", x, " is outside [0, ", c.numel(), "] in a realigned frame");
  return x + static_cast<int64_t>(buf[3]);
}
}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("literal", &literal);
  m.def("literal_locals", &literal_locals);
  m.def("strings", &strings);
  m.def("number", &number);
  m.def("literal_realigned", &literal_realigned);
  m.def("number_realigned", &number_realigned);
}
"""


def _repro_flags(variant: str) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) of a variant: the library's own (kernels/cpu_library.py), less one."""
    from pdserve.kernels import cpu_library

    full = list(cpu_library._cflags())
    isa = set(cpu_isa.compile_flags())
    return {
        "library": (full, ["-fopenmp"]),
        "no-fast-math": ([f for f in full if f != "-ffast-math"], ["-fopenmp"]),
        "no-isa-flags": ([f for f in full if f not in isa], ["-fopenmp"]),
        "no-openmp": ([f for f in full if f != "-fopenmp"], []),
        "plain": ([], []),
    }[variant]


def _repro(variant: str, folder: str) -> int:
    """Build the tiny extension with one variant's flags and fail each of its checks in turn."""
    import torch
    from torch.utils import cpp_extension

    cflags, ldflags = _repro_flags(variant)
    namespace = "pdserve_repro_" + variant.replace("-", "_")
    build = Path(folder)
    build.mkdir(parents=True, exist_ok=True)
    source = build / f"{namespace}.cpp"
    source.write_text(_REPRO_SOURCE.replace("NAMESPACE", namespace))
    print(f"REPRO {variant}: cflags {cflags} ldflags {ldflags}", flush=True)
    try:
        cpp_extension.load(
            name=namespace, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
            build_directory=str(build), is_python_module=False, verbose=True,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - reported as the variant's outcome
        print(f"REPRO: build failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return 4
    ops = getattr(torch.ops, namespace)
    calls = {
        "literal": lambda: ops.literal(1),
        "literal_locals": lambda: ops.literal_locals(torch.ones(3)),
        "strings": lambda: ops.strings(2),
        "number": lambda: ops.number(7),
        "literal_realigned": lambda: ops.literal_realigned(torch.ones(3)),
        "number_realigned": lambda: ops.number_realigned(torch.ones(3), 7),
    }
    bad = 0
    for check in REPRO_CHECKS:  # each in a forked child: one that crashes leaves the others to run
        print(f"CALL {check}", flush=True)
        outcome = forked(calls[check])
        bad += outcome != "raised"
        print(f"OUTCOME {check}: {outcome}", flush=True)
    return 3 if bad else 0


def forked(call: Callable[[], object]) -> str:
    """Call in a forked child: 'raised' (a RuntimeError, as a failed TORCH_CHECK raises), 'raised
    nothing', 'raised <another type>', or 'died of <signal>'."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            call()
        except RuntimeError as e:
            print(f"  raised: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            code = 0
        except BaseException as e:  # noqa: BLE001 - the child reports and ends here, whatever it was
            print(f"  raised {type(e).__name__}: {e}", flush=True)
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"died of {_signal_name(os.WTERMSIG(status))}"
    return {0: "raised", 2: "raised another type", 3: "raised nothing"}.get(
        os.WEXITSTATUS(status), f"exit status {os.WEXITSTATUS(status)}"
    )


def _facts_child() -> int:
    """Print the toolchain, the ABI and the library's build, then one line `FACTS {json}`."""
    import torch

    from pdserve.kernels import cpu_library

    facts: dict[str, Any] = {"cap": cpu_isa.cap(), "isa_flags": cpu_isa.compile_flags()}
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        facts["cxx"] = out.splitlines()[0] if out else f"{cxx}: no output"
    except (OSError, subprocess.TimeoutExpired) as e:
        facts["cxx"] = f"{cxx}: {e}"
    facts["torch"] = torch.__version__
    facts["torch_cxx11_abi"] = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    facts["compiled_with_cxx11_abi"] = bool(torch.compiled_with_cxx11_abi())
    facts["pybind11_build_abi"] = str(getattr(torch._C, "_PYBIND11_BUILD_ABI", "?"))
    config = torch.__config__.show()
    print("torch.__config__.show():\n" + config)
    compiler = re.search(r"GCC [\d.]+|clang[\w .-]*", config)
    facts["torch_compiler"] = compiler.group(0) if compiler else "?"
    build_line = re.search(r"Build settings: (.*)", config)
    settings = dict(re.findall(r"(\w+)=(.*?)(?:, (?=[A-Z_]+=)|$)", build_line.group(1))) if build_line else {}
    facts["torch_cxx_compiler"] = settings.get("CXX_COMPILER", "?")
    facts["torch_cxx_flags"] = settings.get("CXX_FLAGS", "?").strip()[:600]
    # What the kernel and C library enforce: shadow stacks (a #CP fault is a SIGSEGV too), their tunables
    facts["kernel"] = platform.release()
    facts["glibc"] = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "?"
    facts["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    with open("/proc/self/status") as f:
        facts["thread_features"] = [line.strip() for line in f if line.startswith("x86_")]
    cpu = cpu_isa.host_flags()
    facts["cpu_flags"] = sorted(
        f for f in cpu if f.startswith(("avx512f", "amx", "user_shstk", "ibt", "shstk"))
    )
    cflags = getattr(cpu_library, "_cflags", None)
    facts["library_cflags"] = cflags() if cflags else "cpu_library._cflags is gone"
    facts["built"] = cpu_library.load()
    build = cpu_library.build_dir()
    facts["instruction_set"] = cpu_library.instruction_set()
    ninja = build / "build.ninja"
    if ninja.is_file():
        text = ninja.read_text()
        print("build.ninja:\n" + text)
        facts["ninja"] = {
            m.group(1): m.group(2).strip()
            for m in re.finditer(r"^(cxx|cflags|post_cflags|ldflags) = (.*)$", text, re.M)
        }
    runtime = re.compile(r"libstdc\+\+|libgcc_s|libgomp|libiomp|libc10\.so|libtorch_cpu|libc\.so|pdserve_cpu")
    library = build / f"{build.name}.so"
    if library.is_file() and shutil.which("ldd"):
        out = subprocess.run(["ldd", str(library)], capture_output=True, text=True, timeout=30).stdout
        print("ldd:\n" + out)
        facts["ldd"] = [line.strip() for line in out.splitlines() if runtime.search(line)]
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if len(line.split()) >= 6}
    facts["mapped"] = sorted(p for p in mapped if runtime.search(p))
    print(json.dumps(facts, indent=1))
    print("FACTS " + json.dumps(facts), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cpu_isa.apply_torch_env()  # before torch loads, as the CLI and the tests' conftest do
    if args[:1] == ["facts"]:
        return _facts_child()
    if args[:1] == ["trigger"] and len(args) == 2 and args[1] in TRIGGERS:
        return _trigger(args[1])
    if args[:1] == ["repro"] and len(args) == 3 and args[1] in VARIANTS:
        return _repro(args[1], args[2])
    print(f"usage: facts | trigger {{{','.join(TRIGGERS)}}} | repro {{{','.join(VARIANTS)}}} FOLDER")
    return 2


if __name__ == "__main__":
    sys.exit(main())
