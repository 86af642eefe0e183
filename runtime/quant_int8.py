"""The int8 modules of weight quantization (runtime/quant.py): w8a16's weight-only linear, w8a8's
linear with dynamic int8 activations, and the tied embedding read from its LM head's int8 codes.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_quant_linear
from pdserve.runtime.host import cpu_has_int8_dot
from pdserve.runtime.quant_plan import dense_plan

# Below this many rows w8a8 runs the weight-only int8 kernel (see runtime/quant.py's docstring).
W8A8_MIN_ROWS = 8


def int8_per_channel(w: torch.Tensor, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of w [N, K] with one fp32 scale per row: (q [N, K] int8, scale [N]), or with
    `packed` the codes in `pack_int8`'s layout [N/16, K, 16] (N a multiple of 16). In slices of rows, so
    that the rounding's float temporaries, and the unpacked codes, stay small beside a vocabulary-sized
    table."""
    n, k = w.shape
    step = max(1, (1 << 20) // k // cpu_quant_linear.ROWS) * cpu_quant_linear.ROWS  # ~1M values a slice
    q = torch.empty(
        (n // cpu_quant_linear.ROWS, k, cpu_quant_linear.ROWS) if packed else (n, k), dtype=torch.int8
    )
    scale = torch.empty(n)
    for i in range(0, n, step):
        rows = w[i : i + step].float()
        s = (rows.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
        codes = torch.round(rows / s[:, None]).clamp(-127, 127).to(torch.int8)
        if packed:
            r = cpu_quant_linear.ROWS
            q[i // r : (i + len(codes)) // r] = cpu_quant_linear.pack_int8(codes)
        else:
            q[i : i + step] = codes
        scale[i : i + step] = s
    return q, scale


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (q * scale)^T + bias, weights read as int8 (w8a16_int8): few rows through pdserve's
    `int8_linear` where this host's build has it (kernels/cpu_quant_linear.cpp), else
    `aten._weight_int8pack_mm`; both multiply in float and scale by the scale in the activation dtype.
    Many rows take the dense copy where `dense_plan()` keeps one; where it keeps none, the kernel runs
    at every row count and the module holds only its packed codes."""

    keeps_codes = False  # whether the [N, K] codes stay beside the packed ones (w8a8's _int_mm reads them)
    qweight: torch.Tensor | None
    scale: torch.Tensor
    bias: torch.Tensor | None
    dense: torch.Tensor | None
    packed: torch.Tensor | None
    scale_f32: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        invariant: bool = False,
        dense_allowed: bool = True,
    ):
        super().__init__()
        n = weight.shape[0]
        fast = cpu_quant_linear.support()[1] and n % cpu_quant_linear.ROWS == 0
        plan = dense_plan()
        # batch-invariant (`invariant`), or a model too big for dense copies (`dense_allowed`, see
        # quant_plan.dense_copies_fit): the kernel at every row count, so no dense copy
        keep_dense = not fast or (plan.keep and dense_allowed and not invariant)
        packed_only = fast and not keep_dense and not self.keeps_codes
        q, scale = int8_per_channel(weight, packed=packed_only)
        self.register_buffer("qweight", q if self.keeps_codes or not fast else None)  # [N, K] int8
        self.register_buffer("scale", scale.to(dtype))  # [N], the activation dtype (the kernel's rule)
        self.register_buffer("scale_f32", self.scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.register_buffer("dense", (q.float() * scale[:, None]).to(dtype) if keep_dense else None)
        self.register_buffer("packed", q if packed_only else cpu_quant_linear.pack_int8(q) if fast else None)
        self.in_features, self.out_features = weight.shape[1], n
        self.invariant = invariant and fast
        self.dense_min_rows = sys.maxsize if self.invariant else plan.min_rows
        self.bind_ops()

    def bind_ops(self) -> None:
        """Look the kernel up once (also after a restore from the cache, runtime/quant_cache.py): a decode
        step calls this module ~120 times, and each Python-level step costs a few microseconds."""
        self.fast_op = torch.ops.pdserve_cpu.int8_linear.default if self.packed is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.dense is not None and x.numel() // self.in_features >= self.dense_min_rows
        ):  # rows, no reshape
            return F.linear(x, self.dense, self.bias)
        if self.fast_op is not None:
            fast: torch.Tensor = self.fast_op(x, self.packed, self.scale_f32, self.bias)
            return fast
        assert self.qweight is not None  # kept wherever there is no fast op
        x2 = x.reshape(-1, x.shape[-1])
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8DynamicLinear(Int8WeightOnlyLinear):
    """w8a8_int8: per-token dynamic int8 activations times int8 weights, int32 accumulation. Only where
    the CPU has int8 dot products (`cpu_has_int8_dot`): without them (AVX2) oneDNN's `_int_mm` sums
    pairs of u8 x s8 products into saturating int16 lanes and returns wrong sums (errors of 1e4 on
    random int8 rows), so there every row count takes the weight-only kernel (w8a16's arithmetic)."""

    keeps_codes = True
    qweight_t: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        invariant: bool = False,
        dense_allowed: bool = True,
    ):
        super().__init__(weight, bias, dtype, invariant, dense_allowed)
        assert self.qweight is not None
        self.register_buffer("qweight_t", self.qweight.t())  # [K, N] view, as _int_mm takes it
        self.int_mm = cpu_has_int8_dot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.invariant or not self.int_mm or not W8A8_MIN_ROWS <= x2.shape[0] < self.dense_min_rows:
            return super().forward(x)
        xf = x2.float()
        xs = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-10)  # [M, 1]
        xq = torch.round(xf / xs).clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, self.qweight_t)  # [M, N] int32
        y = (acc.float() * xs * self.scale_f32).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class PackedInt8Embedding(nn.Module):
    """A tied embedding table read from its LM head's int8 codes (Int8WeightOnlyLinear's `packed`
    [N/16, K, 16] and per-row scales): row i is q[i] * scale[i], the very weights the head multiplies
    by, in the model dtype. Where the head keeps no dense copy, this saves the float table (113 MB for
    the bundled model in fp32); the rows are the head's int8 rounding of the checkpoint's."""

    packed: torch.Tensor
    scale_f32: torch.Tensor

    def __init__(self, head: Int8WeightOnlyLinear, dtype: torch.dtype):
        super().__init__()
        assert head.packed is not None
        self.register_buffer("packed", head.packed, persistent=False)  # shared with the head
        self.register_buffer("scale_f32", head.scale_f32, persistent=False)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_quant_linear.ROWS
        codes = self.packed[ids // rows, :, ids % rows]  # [..., K] int8
        return (codes.float() * self.scale_f32[ids].unsqueeze(-1)).to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, dequantized (a new tensor: for benchmarks, not for the forward)."""
        return self.forward(torch.arange(self.num_embeddings))
