"""Fused elementwise ops for the CPU forward (cpu_fused_ops.cpp), with their torch references.

In bf16 and fp16 torch's eager ops make one pass over the data per op: RMSNorm is six ops, SiLU-and-mul
two, the rotary embedding four. These read the input once, compute in float and write once, rounding
their intermediate values to the dtype where the eager ops store them, so they give the eager path's
values (to an ulp of the exp in SiLU): bf16 greedy output is sensitive to where it rounds. The eager CPU forward uses them for bf16 / fp16 activations
(runtime/models/norm_rope.py, `cpu_fused`); fp32, the exactness reference, and the compiled
decode step (inductor fuses the torch ops itself) keep torch's ops. They live in the `pdserve_cpu`
library (kernels/cpu_library.py).

  rms_norm(x [..., N], weight [N], eps): weight * normalize(x), normalized in float and rounded to x's
      dtype before the weight multiplies it (transformers' order, as the eager path).
  add_rms_norm(x [T, N], residual [T, N], weight [N], eps) -> (rms_norm(s), s), s = x + residual
      rounded to x's dtype: a decoder layer's residual add and the next norm in one pass.
  silu_and_mul(x [T, 2I]) -> [T, I]: silu(first half) * second half.
  rotary_(x [T, H, D], positions [T], cos [P, D], sin_signed [P, D] float32): in place,
      x * cos[pos] + roll(x, D / 2) * sin_signed[pos] (HF's rotate_half with the sign folded in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_library import load

__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "load",
    "rms_norm",
    "rms_norm_ref",
    "rotary_",
    "rotary_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out: torch.Tensor = torch.ops.pdserve_cpu.rms_norm(x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the dtype as the eager add rounds it."""
    out, total = torch.ops.pdserve_cpu.add_rms_norm(x, residual, weight, eps)
    return out, total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.pdserve_cpu.silu_and_mul(x)
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    torch.ops.pdserve_cpu.rotary_(x, positions, cos, sin_signed)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_ref(total, weight, eps), total


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_ref(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin_signed[positions].unsqueeze(1).to(x.dtype)
    return x * c + x.roll(x.shape[-1] // 2, dims=-1) * s
