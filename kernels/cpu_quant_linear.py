"""Weight-only quantized linears for few rows on CPU (cpu_quant_linear.cpp), with their packers and
torch references.

- `int4_linear(x [..., K], packed, n, bias=None) -> [..., n]`: 4-bit codes, a scale and a minimum per
  group of 32 inputs (GGUF's Q4_1). With AVX512-BF16, x is multiplied as bf16 and the result rounded
  to bf16 (`int4_in_bf16()`); with AVX2 + FMA + F16C (or AVX-512 without BF16) in fp32. Either way
  the result comes back in x's dtype. `pack_int4(q, scale, minimum)` lays them out (scales and
  minimums as fp16, as a GGUF file stores them), one layout for every instruction set.
- `int4_linear_a8(x, packed, n, bias=None)` (`--quantization w4a8`, AVX2 and up): the same weights times x
  quantized to int8 per row and group of 32, by integer dot products (`vpmaddubsw`), in float32 out;
  `int4_linear_a8_ref` is its arithmetic in torch.
- `int4_unpack_t_(packed, out)`: the dequantized weights, transposed, into out [K, N] float32, so that
  a model without a dense copy multiplies many rows by torch's GEMM (`x @ out`).
- `int8_linear(x [..., K], packed, scale [N] fp32, bias=None) -> [..., N] in x's dtype`: int8 codes, one scale
  per output row; `pack_int8(q)` lays them out.

Both take blocks of 16 output rows, one register lane a row. At batch 1 on the bundled model they
replace torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`, which read their weights at
~10-12 GB/s (a decode step's profile: 5.1 ms of the projections' int4 calls and 2.3 ms of the int8
LM head in a 13 ms step, Xeon Sapphire Rapids class, 2 threads). `support()` says which of the two
this host's build has; the quantized modules keep torch's kernels where one is missing.
"""

from __future__ import annotations

import functools

import torch

from pdserve.kernels.cpu_library import load

__all__ = [
    "INT4_GROUP",
    "ROWS",
    "int4_dense_ref",
    "int4_a8_support",
    "int4_in_bf16",
    "int4_linear_a8",
    "int4_linear_a8_ref",
    "int4_linear",
    "int4_linear_ref",
    "int4_packable",
    "int4_unpack_t_",
    "int8_linear",
    "int8_linear_ref",
    "pack_int4",
    "pack_int8",
    "support",
]

INT4_GROUP = 32
ROWS = 16  # output rows per block


@functools.cache
def _support_bits() -> int:
    """quant_linear_support()'s bits for this host's build; 0 where the library is not built."""
    return int(torch.ops.pdserve_cpu.quant_linear_support()) if load() else 0


def support() -> tuple[bool, bool]:
    """(int4_linear built, int8_linear built) for this host; both False where the library is not."""
    bits = _support_bits()
    return bool(bits & 1), bool(bits & 2)


def int4_a8_support() -> bool:
    """Whether this build has int4_linear_a8 (int8 activations, integer dot products: AVX2 and up)."""
    return bool(_support_bits() & 8)


def int4_in_bf16() -> bool:
    """Whether this build's int4_linear multiplies in bf16 (AVX512-BF16) rather than in fp32."""
    return bool(_support_bits() & 4)


def int4_packable(n: int, k: int, scale: torch.Tensor, minimum: torch.Tensor) -> bool:
    """Whether a [n, k] weight fits int4_linear: whole blocks and groups, and scales and minimums that
    fp16 holds (normal, finite), so that packing loses nothing torch's bf16 scales would keep."""
    if n % ROWS or k % INT4_GROUP:
        return False
    tiny = torch.finfo(torch.float16).tiny
    big = torch.finfo(torch.float16).max
    s = scale.abs()
    lo = minimum.abs()
    return bool(((s >= tiny) & (s <= big)).all() and ((lo <= big) & ((lo == 0) | (lo >= tiny))).all())


def pack_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Codes q [N, K] (0..15), scale and minimum [N, K/32] -> packed [N/16, K/32, 320] uint8. Each part
    is written into its place in the output (uint8 codes, no concatenation along the last dimension:
    3x faster than building the parts apart and joining them, measured)."""
    n, k = q.shape
    groups = k // INT4_GROUP
    out = torch.empty(n // ROWS, groups, 320, dtype=torch.uint8, device=q.device)
    # [block, row l, group, chunk c, nibble pair s, pair half j] -> [block, group, c, l, j, s]
    codes = q.to(torch.uint8).reshape(n // ROWS, ROWS, groups, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)
    dst = out[..., :256].view(n // ROWS, groups, 4, ROWS, 2, 2)  # [block, group, c, l, j, word byte]
    torch.bitwise_or(codes[..., 0], codes[..., 1] << 4, out=dst[..., 0])  # little-endian 16-bit words
    torch.bitwise_or(codes[..., 2], codes[..., 3] << 4, out=dst[..., 1])
    for t, at in ((scale, 256), (minimum, 256 + 2 * ROWS)):  # [N, G] -> [N/16, G, 16] fp16
        half = t.float().reshape(n // ROWS, ROWS, groups).transpose(1, 2).to(torch.float16)
        out[..., at : at + 2 * ROWS].view(torch.float16).copy_(half)
    return out


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """Codes q [N, K] int8 -> packed [N/16, K, 16] int8 (16 output rows side by side per input)."""
    n, k = q.shape
    return q.reshape(n // ROWS, ROWS, k).transpose(1, 2).contiguous()


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.pdserve_cpu.int4_linear(x, packed, n, bias)
    return out


def int4_linear_a8(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.pdserve_cpu.int4_linear_a8(x, packed, n, bias)
    return out


def int4_linear_a8_ref(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    """int4_linear_a8's arithmetic in torch: x [M, K] to int8 per group of 32 (dx = max|x| / 127, round
    half to even), y = sum over groups of scale * dx * (q . xq) + minimum * dx * sum(xq), in float32."""
    m, k = x.shape
    n = q.shape[0]
    g = x.float().reshape(m, k // INT4_GROUP, INT4_GROUP)
    dx = g.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(dx > 0, torch.round(g / dx.clamp(min=1e-38)), torch.zeros_like(g))
    codes = q.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    dots = torch.einsum("rgi,ngi->rng", xq, codes)
    sc = scale.to(torch.float16).float()[None]
    lo = minimum.to(torch.float16).float()[None]
    d = dx.squeeze(-1)[:, None, :]
    return (dots * sc * d).sum(-1) + (xq.sum(-1)[:, None, :] * d * lo).sum(-1)


def int4_unpack_t_(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.ops.pdserve_cpu.int4_unpack_t_(packed, out)
    return out


def int8_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.pdserve_cpu.int8_linear(x, packed, scale, bias)
    return out


def int4_dense_ref(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """W = q * scale + minimum per group in float32, scales and minimums rounded through fp16 as packed."""
    s = scale.to(torch.float16).float().repeat_interleave(INT4_GROUP, dim=1)
    lo = minimum.to(torch.float16).float().repeat_interleave(INT4_GROUP, dim=1)
    return q.float() * s + lo


def int4_linear_ref(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bf16: bool | None = None
) -> torch.Tensor:
    """x @ W^T in float with W as `int4_dense_ref`: with `bf16` (default: as this build's kernel) x
    rounded to bf16 first and the result rounded to bf16, else in float32."""
    bf16 = int4_in_bf16() if bf16 is None else bf16
    xf = x.to(torch.bfloat16).float() if bf16 else x.float()
    y = xf @ int4_dense_ref(q, scale, minimum).t()
    return y.to(torch.bfloat16) if bf16 else y


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return ((x.float() @ q.float().t()) * scale.float()).to(x.dtype)
