"""Rotary position embedding applied in place to q and k (HF rotate_half, non-interleaved layout).

out[:h] = x[:h] * cos[:h] - x[h:] * sin[:h];  out[h:] = x[h:] * cos[h:] + x[:h] * sin[h:]
with h = head_dim / 2. The cos/sin cache is [max_pos, head_dim / 2] (both halves share it) or
[max_pos, head_dim] (HF's cat(freqs, freqs) layout; each half read from its own columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import FLOAT_DTYPES, check_launchable, check_shape, check_tensor, next_pow2


@triton.jit
def _rotate_heads(
    X,
    stride_h,
    cos1,
    sin1,
    cos2,
    sin2,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    p1 = X + offs_h[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    o2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(p1, o1.to(X.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,  # [T, Hq, D]
    K,  # [T, Hkv, D]
    Cos,  # [max_pos, D / 2] or [max_pos, D]
    Sin,
    Positions,  # [T]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    FULL_CACHE: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos1 = tl.load(Cos + pos * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + pos * stride_sin + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if FULL_CACHE:
        cos2 = tl.load(Cos + pos * stride_cos + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        sin2 = tl.load(Sin + pos * stride_sin + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        cos2 = cos1
        sin2 = sin1
    _rotate_heads(Q + t * stride_qt, stride_qh, cos1, sin1, cos2, sin2, Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(K + t * stride_kt, stride_kh, cos1, sin1, cos2, sin2, K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def apply_rotary_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place at `positions` [T] (int32/int64).

    cos/sin [max_pos, D / 2] or [max_pos, D]. Positions must be < max_pos (not checked on the
    device: reading them would synchronize).
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    check_tensor("k", k, 3, (q.dtype,), dev)
    check_tensor("cos", cos, 2, FLOAT_DTYPES, dev)
    check_tensor("sin", sin, 2, (cos.dtype,), dev)
    check_tensor("positions", positions, 1, (torch.int32, torch.int64), dev)
    T, Hq, D = q.shape
    if D % 2:
        raise ValueError(f"head_dim {D} must be even for rotary embedding")
    check_shape("k", k, (T, k.shape[1], D))
    check_shape("positions", positions, (T,))
    check_shape("sin", sin, tuple(cos.shape))
    if cos.shape[1] not in (D // 2, D):
        raise ValueError(f"cos/sin last dim {cos.shape[1]} must be head_dim/2 ({D // 2}) or head_dim ({D})")
    if T == 0:
        return
    check_launchable(_rotary_kernel, dev)
    half = D // 2
    _rotary_kernel[(T,)](
        q, k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        Q_HEADS=Hq, K_HEADS=k.shape[1], HALF=half, FULL_CACHE=cos.shape[1] == D,
        BLOCK_QH=next_pow2(Hq), BLOCK_KH=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )  # fmt: skip


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference: returns rotated (q, k), fp32 math, HF rotate_half."""
    D = q.shape[-1]
    c = cos[positions.long()].float()  # [T, D/2 or D]
    s = sin[positions.long()].float()
    if c.shape[-1] == D // 2:
        c = torch.cat([c, c], dim=-1)
        s = torch.cat([s, s], dim=-1)
    c, s = c[:, None, :], s[:, None, :]  # [T, 1, D]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rotated = torch.cat([-xf[..., D // 2 :], xf[..., : D // 2]], dim=-1)
        return (xf * c + rotated * s).to(x.dtype)

    return rot(q), rot(k)
