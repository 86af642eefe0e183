"""The C++ fused CPU ops (kernels/cpu_fused_ops.py) against their torch references, and the eager bf16
forward with them against the same forward on torch's ops."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_fused_ops as ops
from pdserve.runtime.models import llama, norm_rope

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# The eager ops' values, to an ulp of the exp (SiLU) or of the summation order (RMSNorm's mean)
TOL = {BF16: (1.6e-2, 1e-2), F16: (2e-3, 1e-3), F32: (1e-5, 1e-5)}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert ops.load(), "the pdserve_cpu kernels did not build"


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_add_rms_norm_matches_the_add_then_the_norm(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    res = (torch.randn(rows, 2 * 576, generator=g) * 3).to(dtype)[:, ::2]  # a strided residual too
    w = torch.randn(576, generator=g).to(dtype)
    got, total = ops.add_rms_norm(x, res, w, 1e-5)
    ref, ref_total = ops.add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(total, ref_total), "the sum must be the eager add's, bit for bit"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    if dtype != F32:
        assert (got == ref).float().mean() > 0.995, "not the eager path's roundings"


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 3, 64), (300, 2048)], ids=str)
def test_rms_norm_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got, ref = ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    if dtype != F32:
        assert (got == ref).float().mean() > 0.995, "not the eager path's roundings"


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 1536), (7, 24)])
def test_silu_and_mul_matches_reference(rows, inter, dtype):
    x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    got, ref = ops.silu_and_mul(x), ops.silu_and_mul_ref(x)
    assert got.shape == (rows, inter)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    if dtype != F32:
        assert (got == ref).float().mean() > 0.995, "not the eager path's roundings"


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
def test_rotary_in_place_on_a_strided_view(dtype):
    g = torch.Generator().manual_seed(2)
    T, nq, nkv, D = 11, 9, 3, 64
    qkv = torch.randn(T, (nq + 2 * nkv) * D, generator=g).to(dtype)
    cos, sin = torch.randn(50, D, generator=g), torch.randn(50, D, generator=g)
    pos = torch.randint(0, 50, (T,), generator=g)
    v_before = qkv[:, (nq + nkv) * D :].clone()
    qk = qkv[:, : (nq + nkv) * D].view(T, nq + nkv, D)  # rows of stride (nq + 2 nkv) * D
    ref = ops.rotary_ref(qk, pos, cos, sin)
    ops.rotary_(qk, pos, cos, sin)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(qk, ref, rtol=rtol, atol=atol)
    if dtype != F32:
        assert torch.equal(qk, ref), "not the eager path's roundings"
    assert torch.equal(qkv[:, (nq + nkv) * D :], v_before), "the values were touched"


def test_bad_arguments_are_errors():
    x = torch.randn(4, 3, 64, dtype=BF16)
    cos = sin = torch.randn(10, 64)
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.rotary_(x, torch.tensor([0, 1, 10, 2]), cos, sin)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rotary_(x, torch.arange(4), cos.to(BF16), sin.to(BF16))
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, torch.ones(32, dtype=BF16), 1e-5)
    with pytest.raises(RuntimeError, match="x and residual"):
        ops.add_rms_norm(x[:, 0], x[:3, 0], torch.ones(64, dtype=BF16), 1e-5)
    with pytest.raises(RuntimeError, match=r"2 \* I"):
        ops.silu_and_mul(torch.randn(4, 7, dtype=BF16))


@pytest.mark.parametrize("name", ["llama3-rope-tied", "qwen3-qknorm"])
def test_the_eager_bf16_forward_takes_them_and_stays_close(tiny_folders, name, monkeypatch):
    """A tiny random model in bf16, every position's logits: with the fused ops (all three run) against
    the same forward on torch's ops; fp32 keeps torch's ops."""
    from torch.profiler import profile

    from pdserve.bench.gpu_parity import extend_logits
    from pdserve.runtime.loader import load_model

    loaded = load_model(tiny_folders[name], dtype="bfloat16")
    prompts = [list(range(3, 3 + n)) for n in (9, 1, 23)]
    with profile() as prof:
        fused = torch.cat(extend_logits(loaded, prompts, page_size=4))
    ran = {e.key for e in prof.key_averages()}
    assert {
        "pdserve_cpu::rms_norm",
        "pdserve_cpu::add_rms_norm",
        "pdserve_cpu::silu_and_mul",
        "pdserve_cpu::rotary_",
    } <= ran
    for module in (llama, norm_rope):  # the layers and the norms both ask
        monkeypatch.setattr(module, "cpu_fused", lambda x, fp32=False: False)
    plain = torch.cat(extend_logits(loaded, prompts, page_size=4))
    # bf16 rounding differs by an ulp here and there: logits agree to bf16 precision, argmax nearly always
    torch.testing.assert_close(fused, plain, rtol=0.05, atol=0.05)
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9
    monkeypatch.undo()
    assert not norm_rope.cpu_fused(torch.zeros(2, dtype=F32)), "fp32 is the exactness reference"
