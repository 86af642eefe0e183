"""What this host's CPU offers the model runtime (BF16 instructions, VNNI/AMX int8), as the
PDSERVE_CPU_ISA cap lets it (kernels/cpu_isa.py), and the one start-up line that says which
instruction set, dtype, quantization and threads a runtime picked, and why."""

from __future__ import annotations

import os

import torch

from pdserve.kernels import cpu_isa


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo, less those PDSERVE_CPU_ISA hides."""
    return cpu_isa.flags()


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


def startup_line(device: torch.device, dtype: torch.dtype, quantization: str, dense: str = "") -> str:
    """E.g. 'cpu (torch AVX2, pdserve kernels avx2, PDSERVE_CPU_ISA native, bf16 no, int8 dot no),
    dtype float32, quantization w4a16 (no dense copy: ...), 2 torch threads on 2 cores'; with a hint
    where a faster configuration is at hand. `dense`: the quantized linears' plan, said in brackets."""
    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        return f"{device}, dtype {name}, quantization {quantization}"
    from pdserve.kernels import cpu_library

    cap = torch.backends.cpu.get_cpu_capability()
    bf16, int8 = cpu_has_bf16(), cpu_has_int8_dot()
    plan = f" ({dense})" if dense and quantization != "none" else ""
    line = (
        f"cpu (torch {cap}, pdserve kernels {cpu_library.instruction_set()}, {cpu_isa.ISA_ENV} "
        f"{cpu_isa.cap()}, bf16 {'yes' if bf16 else 'no'}, int8 dot {'yes' if int8 else 'no'}), "
        f"dtype {name}, quantization {quantization}{plan}, {torch.get_num_threads()} torch threads on "
        f"{os.cpu_count()} cores"
    )
    if bf16 and dtype == torch.float32:
        line += " (this CPU runs --dtype bfloat16 faster; float32 is the exactness reference)"
    return line
