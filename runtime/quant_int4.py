"""The int4 module of weight quantization (runtime/quant.py): w4a16's (and w4a8's) linear, int4 weights
in groups along the input, each with a scale and a minimum (GGUF's Q4_1 blocks at groups of 32).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_quant_linear
from pdserve.runtime.quant_plan import QuantizationError, dense_plan

INT4_GROUP_SIZE = 32


def int4_grouped(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit min/max quantization of w [N, K] in groups of `group` along K:
    (q [N, K] int32 in 0..15, scale [N, K/group], minimum [N, K/group]); w ~ q * scale + minimum."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo


def packed_in_features(packed: torch.Tensor, scales_zeros: torch.Tensor | None, group: int) -> int:
    """K of a packed weight: pdserve's layout [N/16, K/32, 320], or tinygemm's beside its scales [K/g, N, 2]."""
    if scales_zeros is None:
        return int(packed.shape[1]) * cpu_quant_linear.INT4_GROUP
    return int(scales_zeros.shape[0]) * group


class Int4WeightOnlyLinear(nn.Module):
    """w4a16: w = q * scale + minimum per group of 32 along K. Few rows run pdserve's `int4_linear`
    (kernels/cpu_quant_linear.cpp: fp16 scales and minimums, as GGUF stores them) where this host's
    build has it, else tinygemm's packed int4 (`aten._weight_int4pack_mm_for_cpu`, bf16 scales and
    zero points, w = (q - 8) * scale + zero). Many rows take the dense copy where `dense_plan()` keeps
    one, else the weights dequantized into a scratch for that call (`int4_unpack_t_`)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor | None
    bias: torch.Tensor | None
    dense: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        group: int,
        act8: bool = False,
        invariant: bool = False,
        dense_allowed: bool = True,
    ):
        super().__init__()
        n, k = weight.shape
        if k % group:
            raise QuantizationError(f"w4a16 needs input sizes divisible by {group}; a layer has {k}")
        q, scale, lo = int4_grouped(weight, group)
        fast = (
            cpu_quant_linear.support()[0]
            and group == cpu_quant_linear.INT4_GROUP
            and cpu_quant_linear.int4_packable(n, k, scale, lo)
        )
        if fast:
            packed, sz = cpu_quant_linear.pack_int4(q, scale, lo), None
        else:
            # The kernel's zero point is the value of the code 8: minimum + 8 * scale.
            zeros = torch.stack([scale, lo + 8 * scale], dim=-1)  # [N, K/g, 2]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # bf16 whatever the model dtype: the kernel's fp32 path is a slow reference loop (measured
            # 15-50x slower), so fp32 activations are cast to bf16 for the matmul and back.
            sz = zeros.transpose(0, 1).contiguous().to(torch.bfloat16)
        dense = None
        if not fast or (dense_plan().keep and dense_allowed and not invariant):
            dense = (q.reshape(n, k // group, group).float() * scale[..., None] + lo[..., None]).reshape(n, k)
        self._setup(packed, sz, bias, dense, dtype, group, act8 and fast, invariant and fast)

    @classmethod
    def from_packed(
        cls,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        act8: bool = False,
        invariant: bool = False,
        dense_allowed: bool = True,
    ) -> Int4WeightOnlyLinear:
        """The module around weights already in pdserve's packed layout ([N/16, K/32, 320], as
        `cpu_quant_linear.pack_int4` lays them out): a GGUF file's 4-bit blocks repack straight into it
        (kernels/gguf_repack.py), so no float copy of the weights is ever made. Needs the host's int4
        kernel (`cpu_quant_linear.support()`)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        n = packed.shape[0] * cpu_quant_linear.ROWS
        k = packed.shape[1] * cpu_quant_linear.INT4_GROUP
        dense = None
        if dense_plan().keep and dense_allowed and not invariant:
            w_t = torch.empty(k, n)
            cpu_quant_linear.int4_unpack_t_(packed, w_t)
            dense = w_t.t()
        m._setup(packed, None, bias, dense, dtype, cpu_quant_linear.INT4_GROUP, act8, invariant)
        return m

    def _setup(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor | None,
        bias: torch.Tensor | None,
        dense: torch.Tensor | None,
        dtype: torch.dtype,
        group: int,
        act8: bool,
        invariant: bool,
    ) -> None:
        """The buffers and row plan: `scales_zeros` only beside tinygemm's packing (no pdserve kernel)."""
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        # w4a8: int8 activations where the build has that kernel (cpu_quant_linear.int4_a8_support)
        self.act8 = act8 and cpu_quant_linear.int4_a8_support()
        self.bind_ops()
        self.register_buffer("dense", None if dense is None else dense.to(dtype).contiguous())
        self.group = group
        n = packed.shape[0] * cpu_quant_linear.ROWS if scales_zeros is None else scales_zeros.shape[1]
        self.in_features, self.out_features = packed_in_features(packed, scales_zeros, group), n
        # The kernel at every row count: batch-invariant, w4a8 without a dense copy (see the module
        # docstring), or a model too big for dense copies on a host whose kernel multiplies in bf16: there
        # the kernel at 78 rows took 7.5 ms against 6.5 for a bf16 GEMM on dense weights and 47 for the
        # scratch (a 16384 x 2048 projection, AMD EPYC AVX512-BF16, 2 threads). Elsewhere a dense copy or
        # a scratch from `dense_plan().min_rows` rows on.
        self.invariant = invariant
        every_row = self.invariant or (dense is None and (self.act8 or dense_plan().keep))
        self.dense_min_rows = sys.maxsize if every_row else dense_plan().min_rows

    def bind_ops(self) -> None:
        """The kernel, looked up once (see Int8WeightOnlyLinear.bind_ops): pdserve's int4 kernel where
        the weights are in its layout (no tinygemm scales beside them)."""
        op = torch.ops.pdserve_cpu.int4_linear_a8 if self.act8 else torch.ops.pdserve_cpu.int4_linear
        self.fast_op = op.default if self.scales_zeros is None else None

    def decode_weights(self) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """([dense, packed], bias) for the one-call CPU decode layer (kernels/cpu_decode_layer.py), which
        makes forward's calls itself (an empty dense: none kept, the packed weights dequantized there);
        None where forward runs torch's kernel instead."""
        if self.fast_op is None:
            return None
        dense = self.dense if self.dense is not None else self.packed.new_empty(0, dtype=torch.float32)
        return [dense, self.packed], self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features >= self.dense_min_rows:  # rows, without a reshape
            if self.dense is not None:
                return F.linear(x, self.dense, self.bias)
            return self._unpacked(x)
        if self.fast_op is not None:
            fast: torch.Tensor = self.fast_op(x, self.packed, self.out_features, self.bias)
            return fast
        x2 = x.reshape(-1, x.shape[-1])
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.to(torch.bfloat16), self.packed, self.group, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _unpacked(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with W dequantized (fp32, transposed) into a scratch for this call only."""
        w_t = x.new_empty(self.in_features, self.out_features, dtype=torch.float32)
        cpu_quant_linear.int4_unpack_t_(self.packed, w_t)
        y = (x.float() @ w_t).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y
