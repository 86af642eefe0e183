"""GGUF tensors to float32 and to packed int4 in C++ (kernels/gguf_dequant.py, cpu_gguf_dequant.cpp):
dequantization against the `gguf` package's numpy bit for bit (every type, random valid blocks, and
every fp16 bit pattern as a scale), rounding to int4 against pack_int4(*int4_grouped(...)) byte for
byte (ties included, which -ffast-math's reciprocals would break), the float input in three dtypes,
the torch fallbacks, zeros of both signs, the shapes refused, and the same again under
PDSERVE_CPU_ISA=avx2 on an AVX-512 host (a child process: the cap picks the build when it first loads)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pdserve.bench.gguf_blocks import random_tensor
from pdserve.kernels import cpu_quant_linear as ql
from pdserve.kernels import gguf_dequant as gd
from pdserve.kernels import gguf_repack as gr
from pdserve.runtime.quant_int4 import int4_grouped

REPO = Path(__file__).resolve().parents[2]
TYPES = sorted(gd.DEQUANTIZABLE)
needs_library = pytest.mark.skipif(not gd._library(), reason="the pdserve_cpu library is not built here")


def random_rows(ggml_type: int, n: int, k: int, seed: int) -> np.ndarray:
    """Valid random rows [n, row bytes]: benchmarks/gguf_blocks.py's blocks (BF16: normal draws)."""
    rng = np.random.default_rng(seed)
    if ggml_type == 30:
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) * 0.02).bfloat16()
        return w.view(torch.uint8).numpy()
    return random_tensor(rng, GGMLQuantizationType(ggml_type), n, k)


def numpy_dequantized(raw: np.ndarray, ggml_type: int, k: int) -> torch.Tensor:
    return torch.from_numpy(
        gguf.quants.dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(-1, k).copy()
    )


def torch_int4(w: torch.Tensor) -> torch.Tensor:
    return ql.pack_int4(*int4_grouped(w, 32))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_tables_are_ggufs() -> None:
    for t, name in gd.DEQUANTIZABLE.items():
        assert GGMLQuantizationType(t).name == name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(t)] == gd.BLOCKS[t]


@needs_library
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("n,k", [(3, 256), (48, 768), (160, 2304)])
def test_dequantize_is_numpys_bit_for_bit(ggml_type: int, n: int, k: int) -> None:
    raw = random_rows(ggml_type, n, k, seed=n + k + ggml_type)
    out = gd.dequantize(raw, ggml_type, k)
    assert out.dtype == torch.float32 and out.shape == (n, k)
    assert _same_bits(out, numpy_dequantized(raw, ggml_type, k))


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN may be any NaN (which operand's payload an operation keeps is the
    hardware's and the order's, and numpy makes no promise of it either)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and _same_bits(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


@needs_library
@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t != 0 and t != 30])
def test_every_fp16_field_dequantizes_as_numpy(ggml_type: int) -> None:
    """Blocks' fp16 fields (d, m, dmin; F16's weights) drawn from the 65536 bit patterns, each once where
    the blocks are that many: subnormals, infinities, NaNs, zeros of both signs; random bytes elsewhere."""
    weights, size = gd.BLOCKS[ggml_type]
    rng = np.random.default_rng(ggml_type)
    n, blocks = (64, 1024) if weights < 256 else (64, 256)
    raw = rng.integers(0, 256, (n, blocks, size), dtype=np.uint8)
    for o in [208] if ggml_type == 14 else [0, 2] if ggml_type in (3, 7, 12, 13) else [0]:
        bits = rng.permutation(np.arange(65536, dtype=np.uint16))[: n * blocks]
        raw[..., o : o + 2] = bits.reshape(n, blocks, 1).view(np.uint8)
    raw, k = raw.reshape(n, -1), blocks * weights
    with np.errstate(all="ignore"):
        assert _same_or_both_nan(gd.dequantize(raw, ggml_type, k), numpy_dequantized(raw, ggml_type, k))


@needs_library
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("n,k", [(16, 256), (48, 768), (160, 2304)])
def test_gguf_to_int4_is_int4_grouped_byte_for_byte(ggml_type: int, n: int, k: int) -> None:
    """The op rounds every type by min/max (the 4-bit ones too, which to_int4 repacks instead)."""
    raw = random_rows(ggml_type, n, k, seed=3 * n + k + ggml_type)
    packed = torch.ops.pdserve_cpu.gguf_to_int4(gr.raw_tensor(raw), ggml_type, k)
    assert packed.dtype == torch.uint8 and packed.shape == (n // 16, k // 32, 320)
    assert torch.equal(packed, torch_int4(numpy_dequantized(raw, ggml_type, k)))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_to_int4_repacks_the_4_bit_types_and_rounds_the_rest(ggml_type: int) -> None:
    n, k = 48, 512
    raw = random_rows(ggml_type, n, k, seed=ggml_type)
    packed = gd.to_int4(raw, ggml_type, k)
    if ggml_type in gr.REPACKABLE:
        assert torch.equal(packed, ql.pack_int4(*gr.q4_codes(raw, ggml_type, k)))
    else:
        assert torch.equal(packed, torch_int4(numpy_dequantized(raw, ggml_type, k)))


def _float_cases() -> dict[str, torch.Tensor]:
    """Weights whose (w - lo) / scale land on ties and near them: what a reciprocal or a folded rounding
    gets wrong (measured: thousands of bytes differ in these cases built with -ffast-math's divisions)."""
    g = torch.Generator().manual_seed(0)
    n, k = 64, 1024
    steps = torch.randint(0, 31, (n, k // 32, 32), generator=g).float() / 2
    scales = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4
    return {
        "normal": torch.randn(n, k, generator=g) * 0.02,
        "integers": torch.randint(-20, 20, (n, k), generator=g).float(),
        "halves": torch.randint(-40, 40, (n, k), generator=g).float() / 2,
        "ties": (steps * scales).reshape(n, k),
        "tiny spans": 1 + torch.randn(n, k, generator=g) * 1e-12,
        "constant": torch.full((n, k), 0.3),
    }


@needs_library
@pytest.mark.parametrize("case", sorted(_float_cases()))
@pytest.mark.parametrize("dtype", gd.FLOAT_DTYPES)
def test_float_to_int4_is_int4_grouped_byte_for_byte(case: str, dtype: torch.dtype) -> None:
    w = _float_cases()[case].to(dtype)
    assert torch.equal(gd.float_to_int4(w), torch_int4(w))
    assert torch.equal(gd.float_to_int4(w.t().contiguous().t()), torch_int4(w))  # strided input too


def test_the_torch_fallbacks_are_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gd, "_library", lambda: False)
    monkeypatch.setattr(gd, "_SLICE_VALUES", 16 * 256)  # several slices, joined
    raw, k = random_rows(14, 64, 512, seed=1), 512
    assert _same_bits(gd.dequantize(raw, 14, k), numpy_dequantized(raw, 14, k))
    assert torch.equal(gd.to_int4(raw, 14, k), torch_int4(numpy_dequantized(raw, 14, k)))
    f32 = random_rows(0, 32, 64, seed=2)
    out = gd.dequantize(f32, 0, 64)
    out += 1  # a copy, not a view of the (read-only) bytes
    w = _float_cases()["ties"].bfloat16()
    assert torch.equal(gd.float_to_int4(w), torch_int4(w))


@needs_library
def test_zeros_of_both_signs_keep_their_value() -> None:
    """A group of zeros and positives, +0 and -0 both there: the minimum stored is a zero of either sign
    (which one follows the comparisons' order), the codes and scale as torch's."""
    w = torch.rand(16, 64) + 0.5
    w[:, 0:8], w[:, 8:16] = 0.0, -0.0
    w[:, 32:40], w[:, 40:48] = -0.0, 0.0
    ours, ref = gd.float_to_int4(w), torch_int4(w)
    assert torch.equal(ours[..., :288], ref[..., :288])
    assert torch.equal(ours[..., 288:].view(torch.float16), ref[..., 288:].view(torch.float16))  # -0 == 0


@needs_library
def test_scales_fit_as_int4_packable_says() -> None:
    w = torch.randn(32, 256) * 0.02
    assert gd.int4_scales_fit(gd.float_to_int4(w)) and ql.int4_packable(32, 256, *int4_grouped(w, 32)[1:])
    w[3, 32:64] = 0.25  # a constant group: scale 1e-10, below fp16's normals
    assert not gd.int4_scales_fit(gd.float_to_int4(w))
    assert not ql.int4_packable(32, 256, *int4_grouped(w, 32)[1:])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: gd.dequantize(np.zeros((16, 34), np.uint8), 9, 32), "GGML type 9 is not one of"),
        (lambda: gd.dequantize(np.zeros((16, 210), np.uint8), 14, 288), "Q6_K rows of k=288 weights are not"),
        (
            lambda: gd.to_int4(np.zeros((16, 40), np.uint8), 8, 32),
            r"Q8_0 bytes for k=32 must be uint8 \[N, 34\]",
        ),
        (lambda: gd.to_int4(np.zeros((24, 210), np.uint8), 14, 256), r"\[24, 256\] weight does not fit"),
        (lambda: gd.float_to_int4(torch.zeros(16, 48)), r"\[16, 48\] weight does not fit"),
        (lambda: gd.float_to_int4(torch.zeros(16, 32, dtype=torch.float64)), "not torch.float64"),
    ],
)
def test_what_does_not_fit_is_refused_by_name(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        call()


@needs_library
def test_the_ops_refuse_what_does_not_fit() -> None:
    with pytest.raises(RuntimeError, match="GGML type 9 is not one of"):
        torch.ops.pdserve_cpu.gguf_dequant(torch.zeros(1, 34, dtype=torch.uint8), 9, 32)
    with pytest.raises(RuntimeError, match=r"\[8, 256\] weight does not fit int4_linear"):
        torch.ops.pdserve_cpu.gguf_to_int4(torch.zeros(8, 210, dtype=torch.uint8), 14, 256)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.pdserve_cpu.float_to_int4(torch.zeros(16, 32, dtype=torch.int32))


@needs_library
def test_the_ops_have_fakes_for_tracing() -> None:
    raw = torch.from_numpy(random_rows(14, 16, 512, seed=1))
    torch.library.opcheck(torch.ops.pdserve_cpu.gguf_dequant.default, (raw, 14, 512))
    torch.library.opcheck(torch.ops.pdserve_cpu.gguf_to_int4.default, (raw, 14, 512))
    torch.library.opcheck(torch.ops.pdserve_cpu.float_to_int4.default, (torch.randn(16, 64),))
