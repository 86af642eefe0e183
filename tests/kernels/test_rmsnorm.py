"""Fused RMSNorm (with and without the residual add) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rmsnorm import rms_norm, rms_norm_ref

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("tokens,hidden,dtype", [(1, 64, F32), (7, 96, F32), (5, 576, BF16), (3, 2048, BF16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(check, device, tokens, hidden, dtype, with_residual):
    g = torch.Generator().manual_seed(tokens + hidden)
    x = (3 * torch.randn(tokens, hidden, generator=g)).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    r = torch.randn(tokens, hidden, generator=g).to(dtype).to(device) if with_residual else None
    out = torch.full_like(x, float("nan"))
    got = rms_norm(x, w, 1e-5, residual=r, out=out)
    want = rms_norm_ref(x, w, 1e-5, residual=r)
    if with_residual:
        check(got[0], want[0])
        check(got[1], want[1])  # the new residual stream: x + residual
        assert got[0].data_ptr() == out.data_ptr()
    else:
        check(got, want)
    # against torch's own RMSNorm as a second opinion on the reference
    s = want[1] if with_residual else x
    ref2 = torch.nn.functional.rms_norm(s.float(), (hidden,), w.float(), eps=1e-5)
    check(out, ref2.to(dtype))


def test_rows_with_strides(check, device):
    """Rows of a wider buffer: the kernel honours the row stride."""
    base = torch.randn(4, 200).to(device)
    x = base[:, :128]
    w = torch.randn(128).to(device) + 1
    check(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


def test_wrapper_rejects_bad_arguments(device):
    x = torch.randn(2, 64).to(device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32).to(device), 1e-6)
    with pytest.raises(TypeError, match="residual"):
        rms_norm(x, torch.ones(64).to(device), 1e-6, residual=x.to(BF16))
    with pytest.raises(ValueError, match="2 dims"):
        rms_norm(x[None], torch.ones(64).to(device), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_large_gpu(check):
    x = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(8192, device="cuda", dtype=BF16) + 1
    out, res = rms_norm(x, w, 1e-5, residual=r)
    ro, rr = rms_norm_ref(x, w, 1e-5, residual=r)
    check(out, ro)
    check(res, rr)
