"""The few-row quantized linears in C++ (kernels/cpu_quant_linear.py) against their float references:
exactly where every value is exact, closely on random weights, for every row-tile and block-tile shape,
and the quantized modules taking them (or torch's kernels where a weight does not fit). Which form ran
(AVX-512 with bf16 products, or AVX2 / AVX-512 in fp32) is in the session's header line; the AVX2 form
runs on AVX-512 hosts too, under PDSERVE_CPU_ISA=avx2 (tests/kernels/test_isa_cap.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_quant_linear as ql
from pdserve.runtime.quant_int4 import Int4WeightOnlyLinear, int4_grouped
from pdserve.runtime.quant_int8 import Int8WeightOnlyLinear, int8_per_channel
from pdserve.runtime.quant_plan import UNPACK_MIN_ROWS, dense_plan

INT4, INT8 = ql.support()
needs_int4 = pytest.mark.skipif(
    not INT4, reason="this CPU's build has no int4_linear (needs AVX2 + FMA + F16C)"
)
needs_int8 = pytest.mark.skipif(
    not INT8, reason="this CPU's build has no int8_linear (needs AVX2 + FMA + F16C)"
)

# Rows 1-9 cover the row tiles (4, 3, 2, 1 and their sums); 13 and 208/16 blocks leave tails after the
# 8-, 4- and 2-block tiles and split unevenly between threads.
ROWS = [1, 2, 3, 4, 5, 7, 9]
SHAPES = [(16, 32), (48, 96), (208, 576), (576, 1536)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _exact_int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and minimums whose products with small integer inputs are exact in fp32 and fp16."""
    g = _gen(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (n, k // 32), generator=g)]
    minimum = torch.tensor([-8.0, -4.0, 0.0, 3.0])[torch.randint(0, 4, (n, k // 32), generator=g)]
    return q, scale, minimum


@needs_int4
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int4_exact_where_every_value_is(n: int, k: int, rows: int) -> None:
    q, scale, minimum = _exact_int4(n, k, n + k + rows)
    x = torch.randint(-2, 3, (rows, k), generator=_gen(rows)).to(torch.bfloat16)
    y = ql.int4_linear(x, ql.pack_int4(q, scale, minimum), n)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert torch.equal(y, ql.int4_linear_ref(x, q, scale, minimum).to(torch.bfloat16))


@needs_int4
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_int4_close_on_random_weights(n: int, k: int, rows: int) -> None:
    g = _gen(n * k + rows)
    q, scale, minimum = int4_grouped(torch.randn(n, k, generator=g) * 0.05, 32)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    y = ql.int4_linear(x, ql.pack_int4(q, scale, minimum), n).float()
    ref = ql.int4_linear_ref(x, q, scale, minimum).float()
    # the same products, summed in another order: bf16 output rounding (2^-8) dominates
    assert ((y - ref).abs() <= 2**-7 * ref.abs() + 1e-3 * ref.abs().max()).all()


@needs_int8
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_exact_where_every_value_is(n: int, k: int, rows: int, dtype: torch.dtype) -> None:
    g = _gen(n + k + rows)
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scale = torch.tensor([0.25, 0.5, 1.0])[torch.randint(0, 3, (n,), generator=g)]
    x = torch.randint(-3, 4, (rows, k), generator=g).to(dtype)
    y = ql.int8_linear(x, ql.pack_int8(q), scale)
    assert y.dtype == dtype and y.shape == (rows, n)
    assert torch.equal(y, ql.int8_linear_ref(x, q, scale))


@needs_int8
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_close_on_random_weights(rows: int) -> None:
    g = _gen(rows)
    q, scale = int8_per_channel(torch.randn(208, 576, generator=g))
    x = torch.randn(rows, 576, generator=g)
    y = ql.int8_linear(x, ql.pack_int8(q), scale)
    ref = ql.int8_linear_ref(x, q, scale)
    assert ((y - ref).abs() <= 1e-5 * ref.abs().max()).all()


@needs_int4
@needs_int8
def test_shapes_dtypes_bias_and_strides() -> None:
    """[..., K] inputs of any float dtype and row stride; the bias added as the eager add adds it."""
    n, k = 48, 96
    q, scale, minimum = _exact_int4(n, k, 7)
    p4 = ql.pack_int4(q, scale, minimum)
    q8 = torch.randint(-127, 128, (n, k), generator=_gen(8)).to(torch.int8)
    s8 = torch.full((n,), 0.5)
    bias = torch.randn(n, generator=_gen(9))
    wide = torch.randint(-2, 3, (2, 3, 2 * k), generator=_gen(10)).float()
    x = wide[..., :k]  # rows of stride 2k
    assert not x.is_contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        xd, bd = x.to(dtype), bias.to(dtype)
        y4 = ql.int4_linear(xd, p4, n, bd)
        assert y4.shape == (2, 3, n) and y4.dtype == dtype
        ref4 = ql.int4_linear_ref(xd.reshape(-1, k), q, scale, minimum).to(dtype).reshape(2, 3, n) + bd
        assert torch.equal(y4, ref4)
        y8 = ql.int8_linear(xd, ql.pack_int8(q8), s8, bd)
        assert torch.equal(y8, ql.int8_linear_ref(xd.reshape(-1, k), q8, s8).reshape(2, 3, n) + bd)
    empty = torch.zeros(0, k, dtype=torch.bfloat16)
    assert ql.int4_linear(empty, p4, n).shape == (0, n)
    assert ql.int8_linear(empty, ql.pack_int8(q8), s8).shape == (0, n)


@needs_int4
@needs_int8
def test_bad_inputs_are_refused_with_the_reason() -> None:
    q, scale, minimum = _exact_int4(32, 64, 1)
    p4 = ql.pack_int4(q, scale, minimum)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weights take 64"):
        ql.int4_linear(torch.zeros(1, 32, dtype=torch.bfloat16), p4, 32)
    with pytest.raises(RuntimeError, match="rows, not 48"):
        ql.int4_linear(torch.zeros(1, 64, dtype=torch.bfloat16), p4, 48)
    with pytest.raises(RuntimeError, match="uint8"):
        ql.int4_linear(torch.zeros(1, 64, dtype=torch.bfloat16), p4.view(torch.int8), 32)
    with pytest.raises(RuntimeError, match="floating-point"):
        ql.int4_linear(torch.zeros(1, 64, dtype=torch.int32), p4, 32)
    p8 = ql.pack_int8(torch.zeros(32, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="scale must be"):
        ql.int8_linear(torch.zeros(1, 64), p8, torch.ones(16))


def test_int4_packable_refuses_what_fp16_cannot_hold() -> None:
    ok = torch.full((32, 2), 0.01)
    assert ql.int4_packable(32, 64, ok, -ok)
    assert not ql.int4_packable(24, 64, ok, -ok)  # not whole blocks of 16 rows
    assert not ql.int4_packable(32, 48, ok, -ok)  # not whole groups of 32 inputs
    assert not ql.int4_packable(32, 64, torch.full((32, 2), 1e-9), -ok)  # below fp16's normal range
    assert not ql.int4_packable(32, 64, ok, torch.full((32, 2), 1e6))  # beyond fp16
    assert ql.int4_packable(32, 64, ok, torch.zeros(32, 2))  # a zero minimum is exact


@needs_int4
@needs_int8
def test_modules_take_the_kernels_and_fall_back_where_a_weight_does_not_fit() -> None:
    g = _gen(3)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    ref = x.float() @ w.t()
    fast = Int4WeightOnlyLinear(w, None, torch.bfloat16, 32)
    assert fast.fast_op is not None and fast.scales_zeros is None
    assert (fast(x).float() - ref).abs().max() < 0.1 * ref.abs().max()
    # A group of (near) zeros has a scale fp16 cannot hold: torch's int4 kernel takes the layer.
    tiny = w.clone()
    tiny[:, :32] = 1e-12
    slow = Int4WeightOnlyLinear(tiny, None, torch.bfloat16, 32)
    assert slow.fast_op is None and slow.scales_zeros is not None
    ref_tiny = x.float() @ tiny.t()
    assert (slow(x).float() - ref_tiny).abs().max() < 0.1 * ref_tiny.abs().max()
    head = Int8WeightOnlyLinear(w, None, torch.bfloat16)
    assert head.fast_op is not None
    q8, _ = int8_per_channel(w)
    torch_kernel = torch.ops.aten._weight_int8pack_mm(x, q8, head.scale)
    assert (head(x).float() - torch_kernel.float()).abs().max() <= 2**-7 * torch_kernel.float().abs().max()


@needs_int4
@needs_int8
def test_modules_trace_whole_under_torch_compile() -> None:
    """The compiled decode step traces the quantized modules through the ops' fake kernels."""
    g = _gen(4)
    w = torch.randn(64, 128, generator=g) * 0.05
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    mods = torch.nn.Sequential(
        Int4WeightOnlyLinear(w, b, torch.bfloat16, 32), Int8WeightOnlyLinear(w[:, :64], None, torch.bfloat16)
    )
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    compiled = torch.compile(mods, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), mods(x))


@needs_int4
def test_unpacked_weights_are_the_dequantized_ones_transposed() -> None:
    """int4_unpack_t_ gives exactly q * scale + minimum (fp16 scales), as [K, N]."""
    q, scale, minimum = int4_grouped(torch.randn(208, 576, generator=_gen(11)) * 0.05, 32)
    out = torch.full((576, 208), float("nan"))
    ql.int4_unpack_t_(ql.pack_int4(q, scale, minimum), out)
    assert torch.equal(out, ql.int4_dense_ref(q, scale, minimum).t())
    with pytest.raises(RuntimeError, match=r"out must be contiguous float32 \[K, N\]"):
        ql.int4_unpack_t_(ql.pack_int4(q, scale, minimum), torch.zeros(208, 576))


@needs_int4
@needs_int8
def test_without_a_dense_copy_every_row_count_is_served() -> None:
    """Where this host keeps no dense copy (the fp32 int4 kernel), the module holds only packed codes
    and gives the dense product at few rows (kernel) and at many (dequantized into a scratch)."""
    g = _gen(12)
    w = torch.randn(96, 128, generator=g) * 0.05
    lin = Int4WeightOnlyLinear(w, torch.randn(96, generator=g), torch.float32, 32)
    head = Int8WeightOnlyLinear(w, None, torch.float32)
    if dense_plan().keep:
        assert lin.dense is not None and head.dense is not None
        pytest.skip("this host keeps dense copies (int4 in bf16): nothing to check without one")
    assert lin.dense is None and head.dense is None and head.qweight is None
    q, scale, minimum = int4_grouped(w, 32)
    dense = ql.int4_dense_ref(q, scale, minimum)
    for rows in (1, 5, UNPACK_MIN_ROWS):
        x = torch.randn(rows, 128, generator=g)
        ref = x @ dense.t() + lin.bias
        assert torch.allclose(lin(x), ref, rtol=1e-4, atol=1e-4)
        ref8 = ql.int8_linear_ref(x, *int8_per_channel(w))
        assert torch.allclose(head(x), ref8, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ql.int4_a8_support(), reason="this CPU's build has no int4_linear_a8 (needs AVX2)")
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int4_a8_is_its_integer_arithmetic(n: int, k: int, rows: int) -> None:
    """int8 activations per group of 32 and integer dot products: the kernel gives its reference's
    arithmetic (integer sums exact, float rounding aside) for every tile shape, a zero group included."""
    g = _gen(n * k + rows + 1)
    q, scale, minimum = int4_grouped(torch.randn(n, k, generator=g) * 0.05, 32)
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0.0  # a group of zeros: dx = 0
    y = ql.int4_linear_a8(x, ql.pack_int4(q, scale, minimum), n)
    ref = ql.int4_linear_a8_ref(x, q, scale, minimum)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # and close to the float product: int8 activations cost about 0.5% of the output (both terms of a
    # group multiply the same quantized x; the exact sum(x) beside the quantized dot made it 2-3%)
    dense = x @ ql.int4_dense_ref(q, scale, minimum).t()
    assert float((y - dense).norm()) <= 0.01 * float(dense.norm())
