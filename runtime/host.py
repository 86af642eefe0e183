"""What this host's CPU offers the model runtime (BF16 instructions, VNNI/AMX int8), and the one
start-up line that says which dtype, quantization and threads a runtime picked."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16() -> bool:
    """BF16 dot-product instructions (AVX512-BF16 or AMX-BF16): bf16 matmuls beat fp32 ones."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_amx() -> bool:
    """AMX tile instructions (Sapphire Rapids and later Xeons): torch's bf16 GEMM runs on them and
    beats the weight-only int8/int4 kernels from a handful of rows on."""
    return "amx_bf16" in cpu_flags()


def cpu_has_int8_dot() -> bool:
    """int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8) for `torch._int_mm`."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def startup_line(device: torch.device, dtype: torch.dtype, quantization: str) -> str:
    """E.g. 'cpu (AVX512, bf16 yes, int8 dot yes), dtype bfloat16, quantization w4a16, 2 torch threads
    on 2 cores'; with a hint where a faster configuration is at hand."""
    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        return f"{device}, dtype {name}, quantization {quantization}"
    cap = torch.backends.cpu.get_cpu_capability()
    bf16, int8 = cpu_has_bf16(), cpu_has_int8_dot()
    line = (
        f"cpu ({cap}, bf16 {'yes' if bf16 else 'no'}, int8 dot {'yes' if int8 else 'no'}), dtype {name}, "
        f"quantization {quantization}, {torch.get_num_threads()} torch threads on {os.cpu_count()} cores"
    )
    if bf16 and dtype == torch.float32:
        line += " (this CPU runs --dtype bfloat16 faster; float32 is the exactness reference)"
    return line
