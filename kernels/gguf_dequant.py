"""GGUF tensors of the common types to float32, or to int4_linear's packed layout, in C++ at load.

A GGUF file's 4-bit blocks repack straight into int4_linear's layout (kernels/gguf_repack.py); every
other tensor was dequantized by the `gguf` package's numpy code and rounded to 4 bits in torch, which
took most of an 8B Q4_K_M model's load (two thirds of it, profiled: numpy's per-block temporaries, then
int4_grouped's and pack_int4's). cpu_gguf_dequant.cpp does both row by row, on every core, with the
same results:

- `dequantize(raw, ggml_type, k) -> float32 [N, K]`: bit for bit `gguf.quants.dequantize` (every
  product in it is exact in float32, and the one rounding, the addition of a minimum, is done in
  numpy's order).
- `to_int4(raw, ggml_type, k) -> packed [N/16, K/32, 320] uint8`: Q4_0, Q4_1 and Q4_K keep the file's
  own codes (`repack_q4`, exact); every other type is rounded to 4 bits by min/max in groups of 32,
  byte for byte `pack_int4(*int4_grouped(dequantize(raw, ggml_type, k), 32))` (runtime/quant_int4.py:
  the same float32 divisions, ties to even), each group's 32 weights dequantized and rounded in turn
  rather than through a float copy of the tensor.
- `float_to_int4(w) -> packed`: the same rounding of a float32, bfloat16 or float16 [N, K] weight (a
  safetensors checkpoint's), byte for byte `pack_int4(*int4_grouped(w, 32))`.
- `int4_scales_fit(packed)`: whether int4_linear takes the packed weight as `int4_packable` would
  have taken its scales and minimums (fp16, normal, finite), read from the packed bytes.

One exception to "byte for byte": a group whose smallest value is a zero, and that holds zeros of both
signs, may keep -0 as its minimum where torch keeps +0, or the reverse (which one follows the order
of the comparisons); the value, codes and scale are the same. NaN and infinite weights are not
rounded as torch rounds them.

`raw` is a tensor's bytes, [N, row bytes] uint8 (a read-only memmap of the file too, read in place:
`gguf_repack.raw_tensor`). Where the library is not built, each function runs its reference instead:
the `gguf` package's numpy, and int4_grouped and pack_int4, in slices of rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from pdserve.kernels import gguf_repack
from pdserve.kernels.cpu_library import load
from pdserve.kernels.cpu_quant_linear import INT4_GROUP, ROWS, pack_int4

__all__ = [
    "BLOCKS",
    "DEQUANTIZABLE",
    "dequantize",
    "float_to_int4",
    "int4_scales_fit",
    "row_bytes",
    "to_int4",
]

# GGML type id -> name, of the types dequantized here (ids as gguf.GGMLQuantizationType)
DEQUANTIZABLE = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    30: "BF16",
}
# GGML type id -> (weights, bytes) per block (gguf.GGML_QUANT_SIZES)
BLOCKS = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    30: (1, 2),
}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SLICE_VALUES = 1 << 20  # weights per slice of rows on the torch path (its temporaries stay small)


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k weights; a ValueError naming the type and k where k is not whole blocks."""
    if ggml_type not in DEQUANTIZABLE:
        raise ValueError(f"GGML type {ggml_type} is not one of {DEQUANTIZABLE} (the types dequantized here)")
    weights, size = BLOCKS[ggml_type]
    if k <= 0 or k % weights:
        raise ValueError(
            f"{DEQUANTIZABLE[ggml_type]} rows of k={k} weights are not whole blocks of {weights}"
        )
    return k // weights * size


def _checked(raw: torch.Tensor | np.ndarray, ggml_type: int, k: int) -> torch.Tensor:
    t = gguf_repack.raw_tensor(raw)
    size = row_bytes(ggml_type, k)
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != size:
        raise ValueError(
            f"{DEQUANTIZABLE[ggml_type]} bytes for k={k} must be uint8 [N, {size}], not {t.dtype} {list(t.shape)}"
        )
    return t


def _fits_int4(n: int, k: int) -> None:
    if n == 0 or n % ROWS or k % INT4_GROUP:
        raise ValueError(
            f"a [{n}, {k}] weight does not fit int4_linear: N must be a multiple of {ROWS} (and > 0), "
            f"K of {INT4_GROUP}"
        )


@functools.cache
def _library() -> bool:
    """Whether the C++ ops are there: the library built, and their fake implementations registered."""
    if not load():
        return False
    torch.library.register_fake("pdserve_cpu::gguf_dequant")(_dequant_fake)
    torch.library.register_fake("pdserve_cpu::gguf_to_int4")(_to_int4_fake)
    torch.library.register_fake("pdserve_cpu::float_to_int4")(_float_to_int4_fake)
    return True


def _dequant_fake(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    return raw.new_empty((raw.shape[0], k), dtype=torch.float32)


def _to_int4_fake(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    return raw.new_empty((raw.shape[0] // ROWS, k // INT4_GROUP, 320), dtype=torch.uint8)


def _float_to_int4_fake(w: torch.Tensor) -> torch.Tensor:
    return w.new_empty((w.shape[0] // ROWS, w.shape[1] // INT4_GROUP, 320), dtype=torch.uint8)


def _numpy_dequantize(t: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """The reference: the `gguf` package's numpy dequantization, as a new (writable) float32 tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(t.numpy(), GGMLQuantizationType(ggml_type)).reshape(-1, k)
    return torch.from_numpy(np.array(out, dtype=np.float32, copy=ggml_type == 0))  # F32 comes back a view


def dequantize(raw: torch.Tensor | np.ndarray, ggml_type: int, k: int) -> torch.Tensor:
    """GGUF rows [N, row bytes] -> float32 [N, K], bit for bit what `gguf.quants.dequantize` gives."""
    t = _checked(raw, ggml_type, k)
    if _library():
        out: torch.Tensor = torch.ops.pdserve_cpu.gguf_dequant(t, ggml_type, k)
        return out
    return _numpy_dequantize(t, ggml_type, k)


def _sliced_int4(n: int, k: int, rows_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """The torch path: pack_int4(*int4_grouped(rows, 32)) over slices of whole 16-row blocks."""
    from pdserve.runtime.quant_int4 import int4_grouped  # the rounding's definition (imported late:
    # runtime imports kernels)

    step = max(1, _SLICE_VALUES // k // ROWS) * ROWS
    slices = [pack_int4(*int4_grouped(rows_of(i, i + step), INT4_GROUP)) for i in range(0, n, step)]
    return slices[0] if len(slices) == 1 else torch.cat(slices)


def to_int4(raw: torch.Tensor | np.ndarray, ggml_type: int, k: int) -> torch.Tensor:
    """GGUF rows [N, row bytes] -> int4_linear's packed [N/16, K/32, 320] uint8: a 4-bit file's own codes
    (Q4_0, Q4_1, Q4_K: `gguf_repack.repack_q4`), any other type rounded to 4 bits by min/max as
    `pack_int4(*int4_grouped(dequantize(raw, ggml_type, k), 32))` rounds it."""
    if ggml_type in gguf_repack.REPACKABLE:
        return gguf_repack.repack_q4(raw, ggml_type, k)
    t = _checked(raw, ggml_type, k)
    _fits_int4(t.shape[0], k)
    if _library():
        out: torch.Tensor = torch.ops.pdserve_cpu.gguf_to_int4(t, ggml_type, k)
        return out
    return _sliced_int4(t.shape[0], k, lambda a, b: _numpy_dequantize(t[a:b], ggml_type, k))


def float_to_int4(w: torch.Tensor) -> torch.Tensor:
    """A float32, bfloat16 or float16 weight [N, K] -> int4_linear's packed [N/16, K/32, 320] uint8, byte
    for byte `pack_int4(*int4_grouped(w, 32))`."""
    if w.dtype not in FLOAT_DTYPES or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(
            f"float_to_int4 takes a float32, bfloat16 or float16 [N, K] tensor on CPU, not {w.dtype} "
            f"{list(w.shape)} on {w.device}"
        )
    n, k = w.shape
    _fits_int4(n, k)
    if _library():
        out: torch.Tensor = torch.ops.pdserve_cpu.float_to_int4(w)
        return out
    return _sliced_int4(n, k, lambda a, b: w[a:b])


def int4_scales_fit(packed: torch.Tensor) -> bool:
    """Whether a packed weight's scales and minimums are what `int4_packable` lets int4_linear take:
    scales normal and finite fp16, minimums finite and zero or normal (read from the packed fp16; a
    value that rounded onto fp16's range from just outside it counts as in it)."""
    halves = packed[..., 256:].contiguous().view(torch.float16).float()
    scale, minimum = halves[..., :ROWS].abs(), halves[..., ROWS:].abs()
    tiny, big = torch.finfo(torch.float16).tiny, torch.finfo(torch.float16).max
    scales_ok = ((scale >= tiny) & (scale <= big)).all()
    return bool(scales_ok and ((minimum <= big) & ((minimum == 0) | (minimum >= tiny))).all())
