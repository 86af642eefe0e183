"""GGUF 4-bit rows straight into int4_linear's layout (kernels/gguf_repack.py, cpu_gguf_repack.cpp):
the codes against the `gguf` package's own dequantization, the C++ repack against pack_int4 byte for
byte (fp16 rounding of Q4_K's scales included, over every finite fp16 d), int4_linear on the result
against x @ W^T, zero Q4_K sub-block scales, the shapes refused, a read-only memmap taken without a
copy, and the same again under PDSERVE_CPU_ISA=avx2 on an AVX-512 host (a child process: the cap picks
the library's build when it first loads)."""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pdserve.kernels import cpu_quant_linear as ql
from pdserve.kernels import gguf_repack as gr

REPO = Path(__file__).resolve().parents[2]
TYPES = sorted(gr.REPACKABLE)
SHAPES = [(16, 256), (48, 768), (208, 1536)]
needs_library = pytest.mark.skipif(not gr._library(), reason="the pdserve_cpu library is not built here")
needs_int4 = pytest.mark.skipif(not ql.support()[0], reason="this build has no int4_linear")


def _halves(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """fp16 values of realistic size for d, m, dmin: 1e-3..1e-2, either sign."""
    return (rng.uniform(1e-3, 1e-2, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float16)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and minimums [..., 8] -> Q4_K's 12 packed bytes (the inverse of get_scale_min_k4)."""
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    top = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, top], axis=-1).astype(np.uint8)


def random_rows(ggml_type: int, n: int, k: int, seed: int, zero_every: int = 0) -> np.ndarray:
    """Valid random GGUF rows [n, row bytes]: random codes, realistic fp16 fields; with zero_every, about
    one Q4_K sub-block scale in zero_every (and one Q4_0 d) is 0."""
    rng = np.random.default_rng(seed)
    weights, size = gr.BLOCKS[ggml_type]
    blocks = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    halves = 2 if ggml_type == 2 else 4
    fields = _halves(rng, (n, k // weights, halves // 2))
    if ggml_type == 2 and zero_every:
        fields[rng.random(fields.shape) < 1 / zero_every] = 0
    blocks[..., :halves] = fields.view(np.uint8).reshape(n, k // weights, halves)
    if ggml_type == 12:
        sc = rng.integers(0, 64, (n, k // weights, 8), dtype=np.uint8)
        if zero_every:
            sc[rng.random(sc.shape) < 1 / zero_every] = 0
        blocks[..., 4:16] = _k_scales(sc, rng.integers(0, 64, sc.shape, dtype=np.uint8))
    return blocks.reshape(n, -1)


def dequantized(raw: np.ndarray, ggml_type: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).reshape(-1, k))


def _dense(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """q * scale + minimum per group of 32, in fp32, scales as given (not rounded to fp16)."""
    n, k = q.shape
    groups = q.float().reshape(n, k // 32, 32)
    return (groups * scale[..., None] + minimum[..., None]).reshape(n, k)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_codes_give_what_gguf_dequantizes(ggml_type: int, n: int, k: int) -> None:
    raw = random_rows(ggml_type, n, k, seed=n + k + ggml_type, zero_every=8)
    q, scale, minimum = gr.q4_codes(raw, ggml_type, k)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and q.shape == (n, k)
    assert scale.dtype == minimum.dtype == torch.float32 and scale.shape == minimum.shape == (n, k // 32)
    ref = dequantized(raw, ggml_type, k)
    assert torch.equal(_dense(q, scale, minimum), ref)  # the same fp32 arithmetic as gguf's
    packed = ql.int4_dense_ref(q, scale, minimum)  # the scales as the pack stores them, in fp16
    if ggml_type != 12:
        assert torch.equal(packed, ref)  # fp16 already
    else:  # d sc and dmin m rounded to fp16: half an fp16 ulp (2^-11 relative) each, and fp32's rounding
        bound = (15 * scale.abs() + minimum.abs()).repeat_interleave(32, dim=1) * 2**-11 * 1.01
        assert ((packed - ref).abs() <= bound).all()


@needs_library
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_repack_is_pack_int4_byte_for_byte(ggml_type: int, n: int, k: int) -> None:
    raw = random_rows(ggml_type, n, k, seed=3 * n + k + ggml_type, zero_every=8)
    packed = gr.repack_q4(raw, ggml_type, k)
    assert packed.dtype == torch.uint8 and packed.shape == (n // 16, k // 32, 320)
    assert torch.equal(packed, ql.pack_int4(*gr.q4_codes(raw, ggml_type, k)))


@needs_library
@pytest.mark.parametrize("ggml_type", TYPES)
def test_fp16_rounding_is_torchs_over_every_finite_half(ggml_type: int) -> None:
    """d, m and dmin drawn from all finite fp16 bit patterns: products d sc, dmin m and -8 d land on fp16
    subnormals, ties, and past fp16's range (infinity), rounded as torch's float -> half rounds."""
    n, k = 256, 1024
    rng = np.random.default_rng(ggml_type)
    raw = random_rows(ggml_type, n, k, seed=ggml_type).reshape(n, k // gr.BLOCKS[ggml_type][0], -1)
    bits = rng.integers(0, 0x10000, raw.shape[:2] + (2,), dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0x7BFF  # finite only: no infinity, no NaN
    raw[..., :4] = bits.view(np.uint8).reshape(raw.shape[:2] + (4,))
    raw = raw.reshape(n, -1)
    assert torch.equal(gr.repack_q4(raw, ggml_type, k), ql.pack_int4(*gr.q4_codes(raw, ggml_type, k)))


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float, floor: float) -> None:
    """|y - ref| within rel of ref plus floor of the largest |ref|."""
    err = (y.float() - ref.float()).abs()
    assert (err <= rel * ref.float().abs() + floor * ref.float().abs().max()).all(), float(err.max())


def _check_linear(x: torch.Tensor, raw: np.ndarray, ggml_type: int, n: int, k: int) -> None:
    """int4_linear on the repack against x @ W^T in float64 with W as gguf dequantizes it (bf16 kernels
    round x and y to bf16, 2^-9 relative each; fp32 ones differ by the fp16 rounding of Q4_K's scales,
    2^-11 a weight), and against int4_linear_ref on q4_codes' codes, the kernel's own arithmetic (to a
    bf16 ulp, or fp32 sums in another order)."""
    y = ql.int4_linear(x, gr.repack_q4(raw, ggml_type, k), n)
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], n)
    bf16 = ql.int4_in_bf16()
    _close(
        y,
        x.double() @ dequantized(raw, ggml_type, k).double().t(),
        *((2**-7, 2**-8) if bf16 else (2**-9, 2**-10)),
    )
    own = ql.int4_linear_ref(x, *gr.q4_codes(raw, ggml_type, k))
    _close(y, own, *((2**-7, 2**-8) if bf16 else (1e-5, 1e-5)))


@needs_int4
@needs_library
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_linear_on_the_repack_is_x_times_the_dequantized(ggml_type: int, rows: int) -> None:
    n, k = 208, 1536
    raw = random_rows(ggml_type, n, k, seed=rows + ggml_type)
    _check_linear(torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)), raw, ggml_type, n, k)


@needs_int4
@needs_library
@pytest.mark.parametrize("ggml_type", [2, 12])
def test_zero_scales_are_right_in_int4_linear(ggml_type: int) -> None:
    """A Q4_K sub-block with scale 0 (or a Q4_0 block with d = 0) holds only its minimum: int4_linear
    gives that, though int4_packable refuses such scales for weights quantized from floats."""
    n, k = 48, 768
    raw = random_rows(ggml_type, n, k, seed=11, zero_every=3)
    q, scale, minimum = gr.q4_codes(raw, ggml_type, k)
    assert (scale == 0).float().mean() > 0.2 and not ql.int4_packable(n, k, scale, minimum)
    _check_linear(torch.randn(3, k, generator=torch.Generator().manual_seed(5)), raw, ggml_type, n, k)


@pytest.mark.parametrize(
    "ggml_type,n,k,match",
    [
        (12, 24, 256, r"\[24, 256\] weight does not fit int4_linear"),
        (2, 0, 64, r"\[0, 64\] weight does not fit"),
        (12, 16, 288, "Q4_K rows of k=288 weights are not whole blocks of 256"),
        (3, 16, 48, "Q4_1 rows of k=48 weights are not whole blocks of 32"),
        (8, 16, 256, "GGML type 8 is not one of"),
    ],
)
def test_shapes_that_do_not_fit_are_refused_by_name(ggml_type: int, n: int, k: int, match: str) -> None:
    weights, size = gr.BLOCKS.get(ggml_type, (32, 34))
    raw = np.zeros((n, max(k // weights, 1) * size), dtype=np.uint8)
    for f in (gr.q4_codes, gr.repack_q4):
        with pytest.raises(ValueError, match=match):
            f(raw, ggml_type, k)


def test_bytes_of_the_wrong_row_length_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"Q4_0 bytes for k=64 must be uint8 \[N, 36\], not torch.uint8 \[16, 40\]"
    ):
        gr.repack_q4(torch.zeros(16, 40, dtype=torch.uint8), 2, 64)


@needs_library
def test_the_op_itself_refuses_rows_not_in_blocks_of_16() -> None:
    with pytest.raises(RuntimeError, match="N=8 is not a multiple of 16"):
        torch.ops.pdserve_cpu.gguf_repack_q4(torch.zeros(8, 144, dtype=torch.uint8), 12, 256)


def test_a_read_only_memmap_is_read_in_place_without_a_warning(tmp_path: Path) -> None:
    n, k = 32, 512
    rows = random_rows(12, n, k, seed=7)
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 24 + rows.tobytes())  # at an offset, as in a file
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=24, shape=rows.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = gr.raw_tensor(mapped)
        packed = gr.repack_q4(mapped, 12, k)
        codes = gr.q4_codes(mapped, 12, k)
    assert t.data_ptr() == mapped.ctypes.data  # the file's pages, not a copy
    assert torch.equal(packed, ql.pack_int4(*codes))
    assert torch.equal(packed, gr.repack_q4(torch.from_numpy(rows), 12, k))


@needs_library
def test_the_op_has_a_fake_for_tracing() -> None:
    raw = torch.from_numpy(random_rows(12, 16, 512, seed=1))
    torch.library.opcheck(torch.ops.pdserve_cpu.gguf_repack_q4.default, (raw, 12, 512))
