"""Which instructions pdserve's CPU code may use: the CPU's own, or fewer where `PDSERVE_CPU_ISA` caps them.

pdserve picks its CPU paths at run time from the CPU's flags: the C++ kernels' build target
(kernels/cpu_library.py), the default dtype (bf16 only where the CPU has bf16 dot products), and the
quantized linears' row crossovers (runtime/quant.py). A machine of one kind can run exactly the paths
of a lesser kind: `PDSERVE_CPU_ISA=avx2` hides AVX-512, AVX-VNNI, BF16 and AMX from all of them, so an
AVX-512 host builds and tests the AVX2 kernels and benchmarks an approximation of an AVX2-only CPU
(same instructions, not the same cores or memory). `avx512` hides AMX only; `native` (the default)
hides nothing. `torch_env()` names the variables that cap torch's own kernels (ATen, oneDNN, MKL) the
same way: they must be set before torch starts, so the CLI sets them for itself and every worker it
launches (pdserve/cli.py), and the test suite for itself (tests/conftest.py).

No torch import here: the CLI reads this before torch loads.
"""

from __future__ import annotations

import functools
import os
import platform

from pdserve import env

__all__ = ["ISA_ENV", "LEVELS", "apply_torch_env", "cap", "compile_flags", "flags", "host_flags", "torch_env"]

ISA_ENV = "PDSERVE_CPU_ISA"
LEVELS = ("native", "avx512", "avx2")
# Flags a cap hides: everything past AVX2 (AVX-512 and its extensions, AVX-VNNI, AMX), or AMX alone.
_PAST_AVX2 = ("avx512", "avx_vnni", "amx")
_PAST_AVX512 = ("amx",)


def cap() -> str:
    """The cap in force: `PDSERVE_CPU_ISA`, or `native`. An unknown value is an error naming it."""
    value = (env.cpu_isa_cap() or "native").strip().lower() or "native"
    if value not in LEVELS:
        raise ValueError(f"{ISA_ENV}={value!r} is not one of {', '.join(LEVELS)}")
    return value


@functools.cache
def host_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def flags() -> frozenset[str]:
    """The host's flags less those the cap hides."""
    hidden = {"native": (), "avx512": _PAST_AVX512, "avx2": _PAST_AVX2}[cap()]
    return frozenset(f for f in host_flags() if not f.startswith(hidden))


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def compile_flags() -> list[str]:
    """The target flags for the C++ kernels: the host's own instruction set, or under a cap the x86-64-v3
    level (AVX2, FMA, F16C, BMI) or AVX-512 without AMX, tuned for the host."""
    level = cap()
    if level == "native" or not _x86():
        return ["-march=native", "-mprefer-vector-width=512"]
    if level == "avx2":
        return ["-march=x86-64-v3", "-mtune=native"]
    # avx512: the host's AVX-512 extensions, no AMX
    return ["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mprefer-vector-width=512"]


def torch_env() -> dict[str, str]:
    """Environment variables that cap torch's own kernels as `cap()` caps pdserve's ({} when native)."""
    level = cap()
    if level == "avx2":
        return {
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        }
    if level == "avx512":
        return {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    return {}


def apply_torch_env() -> None:
    """Set `torch_env()` in this process's environment (values already set are kept); call it before
    torch is imported."""
    for key, value in torch_env().items():
        os.environ.setdefault(key, value)
