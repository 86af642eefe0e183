"""Random but valid GGUF weight blocks, made as bytes rather than by quantizing floats.

Quantizing an 8B model's floats takes minutes; random bytes take seconds. The codes are the random
bytes as drawn; only each block's header is rewritten, in place, so that it is a real block: finite
fp16 scales, K-quant sub-block scales and mins in range, and offsets that centre each sub-block on
zero. The scales are sized so that the dequantized weights have the standard deviation of a trained
model's (about 0.02): activations then stay in range through every layer, and the logits are finite.

Layouts (ggml-common.h): Q4_0 {d, qs[16]}, Q4_1 {d, m, qs[16]}, Q5_0 {d, qh[4], qs[16]},
Q5_1 {d, m, qh[4], qs[16]}, Q8_0 {d, qs[32] int8}, Q4_K {d, dmin, scales[12], qs[128]},
Q5_K {d, dmin, scales[12], qh[32], qs[128]}, Q6_K {ql[128], qh[64], scales[16] int8, d}.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
WEIGHT_STD = 0.02
_JITTER = np.uint16(0x7F)  # the fp16 mantissa's low 7 bits: a scale varies by up to 12% block to block

# The standard deviation of a uniform code over n values, and the code at the centre of that range.
_UNIFORM_STD = {n: float(np.sqrt((n * n - 1) / 12.0)) for n in (16, 32, 64, 256)}

# K-quant sub-block scales: lo | (random & (lo - 1)), i.e. uniform over [lo, 2 lo); their root mean square.
_SUB_SCALE_LO = {Q.Q4_K: 32, Q.Q5_K: 16, Q.Q6_K: 8}


def _rms_of_range(lo: int) -> float:
    values = np.arange(lo, 2 * lo, dtype=np.float64)
    return float(np.sqrt(np.mean(values * values)))


def _fp16_bits(value: float) -> np.uint16:
    return np.float16(value).view(np.uint16) & ~_JITTER


def _set_scale(field: np.ndarray, value: float, signed: bool) -> None:
    """Rewrite a block's 2-byte fp16 scale in place: `value` with the random low mantissa bits already
    there kept as jitter, and (when `signed`) the random sign bit kept too, which centres symmetric
    types on zero."""
    bits = field.view(np.uint16)
    keep = _JITTER | (np.uint16(0x8000) if signed else np.uint16(0))
    np.bitwise_and(bits, keep, out=bits)
    np.bitwise_or(bits, _fp16_bits(value), out=bits)


def _fp16(field: np.ndarray) -> np.ndarray:
    return field.view(np.float16)[:, 0].astype(np.float32)


def _set_offset(field: np.ndarray, scale: np.ndarray, factor: float) -> None:
    """A block's fp16 offset (Q4_1's and Q5_1's m, a K-quant's dmin) as `factor` times its scale."""
    field.view(np.float16)[:, 0] = (scale * factor).astype(np.float16)


def _pack_k_scales(sc: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins (get_scale_min_k4's
    inverse), with each min equal to its scale: with dmin = centre * d that centres every sub-block."""
    packed = np.empty((sc.shape[0], 12), np.uint8)
    hi = (sc[:, 4:] >> 4) << 6
    packed[:, 0:4] = sc[:, :4] | hi
    packed[:, 4:8] = sc[:, :4] | hi
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((sc[:, 4:] & 0xF) << 4)
    return packed


def _fix_k_quant(blocks: np.ndarray, qtype: GGMLQuantizationType, levels: int) -> None:
    lo = _SUB_SCALE_LO[qtype]
    sc = (blocks[:, 4:12] & np.uint8(lo - 1)) | np.uint8(lo)
    blocks[:, 4:16] = _pack_k_scales(sc)
    _set_scale(blocks[:, 0:2], WEIGHT_STD / (_UNIFORM_STD[levels] * _rms_of_range(lo)), signed=False)
    _set_offset(blocks[:, 2:4], _fp16(blocks[:, 0:2]), (levels - 1) / 2.0)


def _fix_q6_k(blocks: np.ndarray) -> None:
    lo = _SUB_SCALE_LO[Q.Q6_K]
    scales = blocks[:, 192:208]
    np.bitwise_and(scales, np.uint8(lo - 1), out=scales)
    np.bitwise_or(scales, np.uint8(lo), out=scales)
    _set_scale(blocks[:, 208:210], WEIGHT_STD / (_UNIFORM_STD[64] * _rms_of_range(lo)), signed=True)


def _fix_headers(blocks: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """Make each random block (one row of `blocks`) valid for its type, in place."""
    if qtype in (Q.Q4_0, Q.Q5_0):  # w = d (q - centre): a random sign on d centres it
        _set_scale(blocks[:, 0:2], WEIGHT_STD / _UNIFORM_STD[16 if qtype == Q.Q4_0 else 32], signed=True)
    elif qtype in (Q.Q4_1, Q.Q5_1):  # w = d q + m, m = -centre d
        levels = 16 if qtype == Q.Q4_1 else 32
        _set_scale(blocks[:, 0:2], WEIGHT_STD / _UNIFORM_STD[levels], signed=False)
        _set_offset(blocks[:, 2:4], _fp16(blocks[:, 0:2]), -(levels - 1) / 2.0)
    elif qtype == Q.Q8_0:  # -128 is no code llama.cpp writes (its int8 dot products assume |q| <= 127)
        codes = blocks[:, 2:].view(np.int8)
        np.maximum(codes, np.int8(-127), out=codes)
        _set_scale(blocks[:, 0:2], WEIGHT_STD / _UNIFORM_STD[256], signed=True)
    elif qtype == Q.Q4_K:
        _fix_k_quant(blocks, qtype, 16)
    elif qtype == Q.Q5_K:
        _fix_k_quant(blocks, qtype, 32)
    elif qtype == Q.Q6_K:
        _fix_q6_k(blocks)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"a row of {cols} is no whole number of {qtype.name} blocks of {block}")
    return cols // block * size


def random_tensor(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """A (rows, row bytes) uint8 array: `rows` rows of `cols` weights of type `qtype`, random and valid.

    F32 and F16 are normal draws of WEIGHT_STD; every block type is random bytes with fixed headers."""
    if qtype in (Q.F32, Q.F16):
        values = rng.standard_normal((rows, cols), dtype=np.float32)
        values *= np.float32(WEIGHT_STD)
        return values.astype(np.float16 if qtype == Q.F16 else np.float32).view(np.uint8)
    nbytes = rows * row_bytes(qtype, cols)
    raw = rng.bit_generator.random_raw((nbytes + 7) // 8).view(np.uint8)[:nbytes]
    _fix_headers(raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype)
    return raw.reshape(rows, -1)


def constant_vector(value: float, n: int) -> np.ndarray:
    """An F32 vector of `value` (a norm's weight), as the bytes add_tensor_info's raw_dtype expects."""
    return np.full(n, value, np.float32).view(np.uint8)
