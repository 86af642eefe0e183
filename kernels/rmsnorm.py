"""Fused RMSNorm, optionally with the residual add of the pre-norm block in the same pass.

Numerics follow the HF Llama layers: the residual sum is rounded to the activation dtype (it is
the new residual stream), its RMS is taken in fp32, and the normed value is rounded to the
activation dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import FLOAT_DTYPES, check_launchable, check_shape, check_tensor, next_pow2


@triton.jit
def _rmsnorm_kernel(
    X,  # [T, N]
    Residual,  # [T, N] or unused
    W,  # [N]
    Out,  # [T, N]
    ResidualOut,  # [T, N] or unused
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, N] with weight [N].

    With `residual` [T, N]: s = x + residual, returns (rms_norm(s) * weight, s), s being the new
    residual stream (like vLLM's fused_add_rms_norm, but out of place). `out` [T, N] may be given.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    dev = x.device
    T, N = x.shape
    check_tensor("weight", weight, 1, FLOAT_DTYPES, dev)
    check_shape("weight", weight, (N,))
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,), dev)
        check_shape("residual", residual, (T, N))
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor("out", out, 2, (x.dtype,), dev)
        check_shape("out", out, (T, N))
    res_out = torch.empty_like(x) if residual is not None else None
    if T > 0:
        check_launchable(_rmsnorm_kernel, dev)
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        block = next_pow2(N)
        _rmsnorm_kernel[(T,)](
            x, r, weight, out, ro,
            x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
            eps,
            N=N, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    if res_out is None:
        return out
    return out, res_out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)
