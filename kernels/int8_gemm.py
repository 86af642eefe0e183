"""Weight-only int8 GEMM (the CUDA side of `w8a16_int8`): y = x @ (q * scale)^T (+ bias).

x [M, K] in fp32/bf16/fp16, q [N, K] int8 with one scale per output channel, scale [N]. Each program
computes a BLOCK_M x BLOCK_N tile: it loads int8 weight tiles (half the bytes of bf16, the point of
the format where decode is memory-bound), converts them to the activation dtype in registers,
accumulates `tl.dot` in fp32 and applies the channel scales once at the end (scaling commutes with
the sum over K). Not wired into the runtime yet: `--quantization` runs torch's CPU kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import (
    FLOAT_DTYPES,
    cdiv,
    check_launchable,
    check_shape,
    check_tensor,
    interpreted,
)


@triton.jit
def _int8_gemm_kernel(
    X,  # [M, K]
    Q,  # [N, K] int8
    S,  # [N]
    B,  # [N] or unused
    Y,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in full fp32 (fp32 inputs; the interpreter's bf16/fp16 dot is wrong)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            X + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        q = tl.load(
            Q + rn[None, :].to(tl.int64) * stride_qn + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0,
        )  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            # ieee: an fp32 dot on CUDA is otherwise TF32 (10-bit mantissa), ~1e-3 off the fp32 reference
            acc += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, q.to(X.dtype.element_ty))
    s = tl.load(S + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = acc * s[None, :]
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
        acc.to(Y.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def int8_weight_only_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (qweight [N, K] int8 * scale [N, 1])^T (+ bias [N]), in x's dtype."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    dev = x.device
    M, K = x.shape
    check_tensor("qweight", qweight, 2, (torch.int8,), dev)
    N = qweight.shape[0]
    check_shape("qweight", qweight, (N, K))
    check_tensor("scale", scale, 1, FLOAT_DTYPES, dev)
    check_shape("scale", scale, (N,))
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES, dev)
        check_shape("bias", bias, (N,))
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    if M == 0 or N == 0:
        return y
    check_launchable(_int8_gemm_kernel, dev)
    block_m = 16 if M <= 16 else 64
    block_n, block_k = 64, 64
    grid = (cdiv(M, block_m), cdiv(N, block_n))
    _int8_gemm_kernel[grid](
        x,
        qweight,
        scale,
        bias if bias is not None else scale,
        y,
        M,
        N,
        K,
        x.stride(0),
        qweight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        UPCAST=interpreted(_int8_gemm_kernel) or x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y


def int8_weight_only_mm_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference: dequantize to fp32, matmul in fp32, round to x's dtype."""
    w = qweight.float() * scale.float()[:, None]
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
