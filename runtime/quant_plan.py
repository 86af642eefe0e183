"""Which path this host's quantized linears take (runtime/quant.py): where a dense copy of the
dequantized weights is kept and from how many rows it (or a scratch) takes over from the packed
kernels (`dense_plan()`), whether w4a8's integer kernel pays, and which modes this host or dtype can
run at all (`check_quantization`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import QUANT_MODES
from pdserve.kernels import cpu_quant_linear
from pdserve.runtime.host import cpu_has_amx

# Hosts whose int4 kernel multiplies in bf16 (AVX512-BF16): from this many rows every mode multiplies
# by a dense copy of the dequantized weights in the model dtype: torch's weight-only kernels are built
# for the memory-bound few-row case, and their time grows with the rows while a bf16 GEMM's hardly
# does. Measured as whole decode steps of the bundled model (w4a16, bf16, 2 threads, Xeon Sapphire
# Rapids class with AMX; both thresholds interleaved in one process, best of 3): at 6 rows 36.5 ms int4
# against 40.7 dense, at 8 rows 36.5 against 39.3, at 9 rows 53.3 against 42.8 (the int4 kernel's time
# jumps between 8 and 9 rows), at 12 rows 50.3 against 42.0, at 14 rows 61.9 against 49.2. Single
# projections on a hot cache put the crossover at 5 rows, but a whole step streams 4x more bytes of
# bf16 weights than of int4 ones. `_int_mm` with its activation quantization (w8a8) loses to the AMX
# bf16 GEMM too (gate_up 231 against 178 us at 8 rows). Without AMX the bf16 GEMM is several times
# slower and 16 is kept (a batch-16 step measured on the same Xeon: bf16 58 ms, w8a8 58, w4a16 78,
# w8a16 86).
DENSE_MIN_ROWS_AMX = 9
DENSE_MIN_ROWS = 16
# Hosts whose int4 kernel multiplies in fp32 (AVX2): no dense copy. A decode step's 120 projections of
# the bundled model, weights streamed from memory (`pdserve bench cpu`, 2 threads, AMD EPYC AVX2-only,
# best of 5): the int4 kernel 5.3 ms at 1 row, 37.7 at 16, 146 at 64; torch's fp32 GEMM on dense weights
# 35.0, 55.8, 122; dequantizing each projection into a scratch before that GEMM 25.4, 72.1, 140. So few
# rows take the kernel, and from about 56 rows (where the lines cross) the scratch; no dense copy pays
# for its memory (540 MB in fp32).
UNPACK_MIN_ROWS = 56
# w4a8's integer kernel against the same GEMM (same host, same bench, while the machine was shared, so
# noisy): 4.2 / 15.8 / 73.0 / 236 ms at 1 / 16 / 64 / 256 rows against 39.0 / 64.8 / 158 / 475 for the
# fp32 GEMM and 36.9 / 90.2 / 177 / 510 for the scratch: no crossover, so w4a8 keeps the kernel throughout.
A8_ROWS_MEASURED = 256


@dataclass(frozen=True)
class DensePlan:
    """How this host's quantized linears multiply many rows: `keep` a dense copy (used from
    `min_rows` rows), or keep none and dequantize into a scratch from `min_rows` rows; `why` for the
    start-up line."""

    keep: bool
    min_rows: int
    why: str


def dense_plan() -> DensePlan:
    """The plan for this host (its flags under the PDSERVE_CPU_ISA cap, and its kernel build)."""
    int4, _ = cpu_quant_linear.support()
    if int4 and not cpu_quant_linear.int4_in_bf16():
        return DensePlan(False, UNPACK_MIN_ROWS, "the fp32 int4 kernel beats the fp32 GEMM below that")
    if cpu_has_amx():
        return DensePlan(True, DENSE_MIN_ROWS_AMX, "AMX bf16 GEMM from 9 rows")
    return DensePlan(True, DENSE_MIN_ROWS, "dense GEMM from 16 rows")


# Dense copies are kept only for models whose projections, in the model dtype, take at most this much:
# the bundled model's (0.27 GB in bf16) pay for themselves in batched steps, but a 1.7B model's would
# add 3.4 GB per worker and an 8B model's 14 GB, private to each worker (the packed weights are shared
# between a host's workers, runtime/quant_cache.py), which a 24 GB host cannot hold twice. Bigger
# models run the packed kernel at few rows and the scratch (`int4_unpack_t_`) or kernel beyond.
DENSE_COPY_MAX_BYTES = 1 << 30


def dense_copies_fit(projection_params: int, dtype: torch.dtype) -> bool:
    """Whether this model's dense copies stay within DENSE_COPY_MAX_BYTES."""
    return projection_params * dtype.itemsize <= DENSE_COPY_MAX_BYTES


def a8_multiplies_faster() -> bool:
    """Whether w4a8's integer kernel beats w4a16's here: where the int4 kernel multiplies in fp32 (AVX2, or
    AVX-512 without BF16) and the build has `int4_linear_a8` (see A8_ROWS_MEASURED)."""
    return cpu_quant_linear.int4_a8_support() and not cpu_quant_linear.int4_in_bf16()


def dense_min_rows() -> int:
    """The row count from which this host's quantized linears take their dense path (see DensePlan)."""
    return dense_plan().min_rows


class QuantizationError(ValueError):
    pass


def check_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with the reason named, a mode this host or dtype cannot run."""
    if mode not in QUANT_MODES:
        raise QuantizationError(f"unknown --quantization {mode!r}; choose {', '.join(QUANT_MODES)}")
    if mode == "none":
        return
    if device.type != "cpu":
        raise QuantizationError(
            f"--quantization {mode} runs on CPU only (torch's packed int8/int4 kernels); "
            f"on {device.type} use --quantization none"
        )
    if dtype == torch.float16:
        raise QuantizationError(f"--quantization {mode} takes --dtype bfloat16 or float32 activations")
