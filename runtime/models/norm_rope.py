"""The decoder's normalization and rotary embedding, and where fused kernels replace their torch ops.

On CUDA, Triton kernels (`fused_kernels`); on CPU in bf16 / fp16 eager forwards, and in fp32 ones of a
quantized model (whose modules runtime/quant.py marks `fused_fp32`), the C++ ops of
kernels/cpu_fused_ops.py (`cpu_fused`); elsewhere torch's ops: the unquantized fp32 model is the
exactness reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_fused_ops


def fused_kernels(device: torch.device) -> bool:
    """Whether the Triton RMSNorm and rotary kernels replace the torch ops: on CUDA (one pass over the
    data each, where torch launches several kernels); on CPU see `cpu_fused`."""
    return device.type == "cuda"


def cpu_fused(x: torch.Tensor, fp32: bool = False) -> bool:
    """Whether the C++ RMSNorm, SiLU-and-mul and rotary (kernels/cpu_fused_ops.py) replace the torch ops
    for activations like x: on CPU for bf16 / fp16, in eager forwards, and for fp32 where `fp32` (a
    quantized model's modules). The unquantized fp32 model (the exactness reference) keeps torch's ops,
    and so does the compiled decode step, whose graph inductor fuses itself."""
    return cpu_fused_for(x.device, x.dtype, fp32)


def cpu_fused_for(device: torch.device, dtype: torch.dtype, fp32: bool = False) -> bool:
    """`cpu_fused` for activations of this device and dtype."""
    allowed = (torch.bfloat16, torch.float16, torch.float32) if fp32 else (torch.bfloat16, torch.float16)
    if device.type != "cpu" or dtype not in allowed or torch.compiler.is_compiling():
        return False
    return cpu_fused_ops.load()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused_fp32 = False  # set by runtime/quant.py on a quantized model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalized x (any leading shape)."""
        if fused_kernels(x.device):
            from pdserve.kernels.rmsnorm import rms_norm  # triton: imported only where it runs

            # [T, H, D] heads (q/k norm) become [T*H, D] rows
            out = rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)
            assert isinstance(out, torch.Tensor)  # no residual given: one tensor back
            return out.view(x.shape)
        if cpu_fused(x, self.fused_fp32):
            return cpu_fused_ops.rms_norm(x, self.weight, self.eps)  # the same roundings as below
        # Normalize in fp32 like transformers, then scale in the input dtype.
        if x.dtype == torch.float32:
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        # Kept in transformers' order in bf16 too: one call with the weight inside (19 against 32 us a
        # row) rounds once instead of twice, and that flipped the bundled model's answer to a test
        # question; the two-step form is what a bf16 checkpoint is validated with.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = x + residual [T, N] in x's dtype: a residual add and the norm after it,
        in one kernel on CUDA and on CPU in bf16 / fp16 (the same values as the add, then forward)."""
        if fused_kernels(x.device):
            from pdserve.kernels.rmsnorm import rms_norm

            out, total = rms_norm(x, self.weight, self.eps, residual=residual)
            return out, total
        if cpu_fused(x, self.fused_fp32):
            return cpu_fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return self.forward(total), total


class Rotary(nn.Module):
    """HF's non-interleaved (rotate_half) RoPE with a precomputed cos/sin table.

    `prepare(positions, dtype)` looks up the rows of one forward once; every layer then rotates with
    them (the lookup and cast are otherwise repeated in each layer, a sizeable share of a CPU decode
    step's small ops)."""

    cos: torch.Tensor  # [max_pos, rot_dim] float32 buffers, registered in __init__
    sin: torch.Tensor
    sin_signed: torch.Tensor  # sin with its first half negated: rotate_half(x) * sin == roll(x) * sin_signed

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)  # [max_pos, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rot_dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        half = emb.shape[-1] // 2
        signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        self.register_buffer("sin_signed", signed, persistent=False)
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.fused_fp32 = False  # set by runtime/quant.py on a quantized model

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """The cos/sin rows [T, 1, D] of this forward's positions, in the activations' dtype."""
        if fused_kernels(positions.device) or cpu_fused_for(positions.device, dtype, self.fused_fp32):
            return  # the fused kernel reads the table itself
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin_signed[positions].unsqueeze(1).to(dtype)
        self._rows = (positions, cos, sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated at `positions` [T] (on CUDA in place, one kernel)."""
        if fused_kernels(q.device):
            from pdserve.kernels.rotary import apply_rotary_

            apply_rotary_(q, k, self.cos, self.sin, positions)
            return q, k
        if cpu_fused(q, self.fused_fp32):
            self.rotate_(positions, q)
            self.rotate_(positions, k)
            return q, k
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """x [T, H, D] rotated in place by the C++ kernel (where `cpu_fused(x)`)."""
        cpu_fused_ops.rotary_(x, positions, self.cos, self.sin_signed)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated at `positions` (torch ops; the rows `prepare` looked up when they are
        these positions')."""
        if self._rows is not None and self._rows[0] is positions and self._rows[1].dtype == x.dtype:
            cos, sin_signed = self._rows[1], self._rows[2]
        else:
            cos = self.cos[positions].unsqueeze(1).to(x.dtype)
            sin_signed = self.sin_signed[positions].unsqueeze(1).to(x.dtype)
        # HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) taken as the halves
        # swapped (one roll) times the signed table: the same values, two ops fewer per layer.
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
