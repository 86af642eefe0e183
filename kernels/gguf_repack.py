"""A GGUF file's 4-bit weights (Q4_0, Q4_1, Q4_K) straight into int4_linear's packed layout.

A GGUF 4-bit tensor already is what `int4_linear` multiplies: 4-bit codes with a scale and a minimum
per group of 32 inputs. Dequantizing it to float and quantizing that again would cost a float copy of
the whole model at load and could only lose precision; these functions read the codes as they are and
lay them out as `pack_int4` does (kernels/cpu_quant_linear.py).

- `q4_codes(raw, ggml_type, k) -> (q uint8 [N, K], scale fp32 [N, K/32], minimum fp32 [N, K/32])`, with
  w = q * scale + minimum exactly as GGUF's dequantization computes it in fp32 (llama.cpp's
  ggml-common.h, the `gguf` package's quants.py):
    Q4_0 (18 bytes / 32): fp16 d, 16 bytes of codes (element j the low nibble of byte j, element j + 16
      its high nibble); w = d (q - 8): scale d, minimum -8 d.
    Q4_1 (20 bytes / 32): fp16 d, fp16 m, the same codes; w = d q + m.
    Q4_K (144 bytes / 256): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums for 8 sub-blocks of
      32, 128 bytes of codes (each 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high);
      w = d sc_j q - dmin m_j: scale d sc_j, minimum -(dmin m_j), both exact in fp32. The pack stores
      them as fp16 (rounded to nearest even), the one rounding this path adds, and only for Q4_K.
  Vectorized torch: the reference, and the path where the C++ library is not built.
- `repack_q4(raw, ggml_type, k) -> packed [N/16, K/32, 320] uint8`: the bytes `pack_int4(*q4_codes(...))`
  gives, by cpu_gguf_repack.cpp's `gguf_repack_q4` where the library is built, by that torch otherwise.

`raw` is the tensor's bytes, [N, row bytes] uint8, rows contiguous (what `gguf.GGUFReader` gives as a
quantized tensor's `data`), as a torch tensor or a numpy array. A numpy array, typically a read-only
memmap of the file, becomes a tensor by `raw_tensor`: `torch.from_numpy` on the same pages, no copy, its
warning that the array is not writable silenced (neither function writes to `raw`; a caller must not
write to that tensor either). Only the pages of the rows read are read from the file.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from pdserve.kernels.cpu_library import load
from pdserve.kernels.cpu_quant_linear import INT4_GROUP, ROWS, pack_int4

__all__ = ["BLOCKS", "REPACKABLE", "q4_codes", "raw_tensor", "repack_q4", "row_bytes"]

# GGML type id -> name, of the types repacked here
REPACKABLE = {2: "Q4_0", 3: "Q4_1", 12: "Q4_K"}
# GGML type id -> (weights, bytes) per block
BLOCKS = {2: (32, 18), 3: (32, 20), 12: (256, 144)}


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k weights; a ValueError naming the type and k where k is not whole blocks."""
    if ggml_type not in REPACKABLE:
        raise ValueError(f"GGML type {ggml_type} is not one of {REPACKABLE} (the 4-bit types repacked here)")
    weights, size = BLOCKS[ggml_type]
    if k <= 0 or k % weights:
        raise ValueError(f"{REPACKABLE[ggml_type]} rows of k={k} weights are not whole blocks of {weights}")
    return k // weights * size


def raw_tensor(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    """raw as a uint8 tensor sharing its memory: a numpy array (a read-only memmap too) without a copy."""
    if isinstance(raw, torch.Tensor):
        return raw
    array = np.asarray(raw)
    if array.dtype != np.uint8:
        raise ValueError(f"GGUF bytes must be uint8, not {array.dtype}")
    with warnings.catch_warnings():
        # "The given NumPy array is not writable": nothing here writes to it.
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.from_numpy(array)


def _checked(raw: torch.Tensor | np.ndarray, ggml_type: int, k: int) -> torch.Tensor:
    """raw as a tensor, after the checks both paths share: a ValueError naming what does not fit."""
    t = raw_tensor(raw)
    size = row_bytes(ggml_type, k)
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != size:
        raise ValueError(
            f"{REPACKABLE[ggml_type]} bytes for k={k} must be uint8 [N, {size}], not {t.dtype} {list(t.shape)}"
        )
    n = t.shape[0]
    if n == 0 or n % ROWS or k % INT4_GROUP:
        raise ValueError(
            f"a [{n}, {k}] weight does not fit int4_linear: N must be a multiple of {ROWS} (and > 0), "
            f"K of {INT4_GROUP}"
        )
    return t


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] their little-endian fp16 as fp32 (a copy of these 2 bytes a block only)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes -> [..., 2, B]: the low nibbles, then the high ones."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _q4_k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] packed bytes -> 6-bit scales and minimums [..., 8] (llama.cpp's get_scale_min_k4)."""
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 0x3F, (top & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 0x3F, (top >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def q4_codes(
    raw: torch.Tensor | np.ndarray, ggml_type: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF rows [N, row bytes] -> codes q uint8 [N, K] (0..15), scale and minimum fp32 [N, K/32]."""
    t = _checked(raw, ggml_type, k)
    n = t.shape[0]
    weights, size = BLOCKS[ggml_type]
    blocks = t.reshape(n, k // weights, size)
    if ggml_type == 12:  # Q4_K
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
        sc, mn = _q4_k_scale_min(blocks[..., 4:16])
        q = _nibbles(blocks[..., 16:].reshape(n, k // weights, 4, 32)).reshape(n, k)
        scale = (d[..., None] * sc.float()).reshape(n, k // INT4_GROUP)
        minimum = -(dmin[..., None] * mn.float()).reshape(n, k // INT4_GROUP)
        return q, scale, minimum
    start = 2 if ggml_type == 2 else 4
    q = _nibbles(blocks[..., start:]).reshape(n, k)
    d = _half(blocks[..., 0:2])
    minimum = -8 * d if ggml_type == 2 else _half(blocks[..., 2:4])
    return q, d, minimum


@functools.cache
def _library() -> bool:
    """Whether the C++ op is there: the library built, and the op's fake implementation registered."""
    if not load():
        return False
    torch.library.register_fake("pdserve_cpu::gguf_repack_q4")(_repack_fake)
    return True


def _repack_fake(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    return raw.new_empty((raw.shape[0] // ROWS, k // INT4_GROUP, 320), dtype=torch.uint8)


def repack_q4(raw: torch.Tensor | np.ndarray, ggml_type: int, k: int) -> torch.Tensor:
    """GGUF rows [N, row bytes] -> int4_linear's packed [N/16, K/32, 320] uint8, equal byte for byte to
    `pack_int4(*q4_codes(raw, ggml_type, k))`."""
    t = _checked(raw, ggml_type, k)
    if _library():
        out: torch.Tensor = torch.ops.pdserve_cpu.gguf_repack_q4(t, ggml_type, k)
        return out
    return pack_int4(*q4_codes(t, ggml_type, k))
