"""Weight quantization at load time (`--quantization`): the model's Linear projections and LM head
replaced by modules that keep int8 or int4 weights and run torch's own quantized kernels.

Modes (SGLang's names):
- `w8a16_int8`: int8 weights, one scale per output channel, activations in the model dtype
  (`aten._weight_int8pack_mm`: the weights are read as int8 and scaled inside the kernel).
- `w8a8_int8`: the same int8 weights; activations quantized per token at run time (dynamic,
  symmetric) and multiplied int8 x int8 -> int32 by `torch._int_mm` (VNNI/AMX on x86), rescaled by
  both scales. Below `W8A8_MIN_ROWS` rows the step is memory-bound and the activation quantization
  costs more than it saves, so such small batches take the weight-only int8 kernel instead. On an AMX
  host the dense bf16 copy (below) takes over from 9 rows, leaving `_int_mm` only batches of 8. A CPU
  without int8 dot products (AVX2) runs it as w8a16: oneDNN's `_int_mm` there saturates int16 sums.
- `w4a8`: w4a16's weights; activations quantized at run time to int8 per row and group of 32 inputs
  (symmetric) and multiplied by integer dot products (`int4_linear_a8`: llama.cpp's Q4_1 x Q8_1 on
  CPU), where the host's build has the kernel (AVX2 and up), and w4a16's kernel where the build has
  only that. Where no dense copy is kept (the int4 kernel multiplies in fp32) it runs at every row
  count: it beats torch's fp32 GEMM at every size measured (`A8_ROWS_MEASURED`), so prefill takes it
  too, and a row's result never depends on how many rows share its call. `--quantization auto` picks
  it for a Q4 GGUF file on such hosts (as llama.cpp computes that file there; accuracy in
  docs/benchmarks.md).
- `w4a16`: int4 weights, asymmetric, groups of 32 along the input (one scale and one zero point per
  group), activations in the model dtype (`aten._weight_int4pack_mm_for_cpu`, tinygemm's layout).
  Groups of 32 with min/max quantization are exactly GGUF's Q4_1 blocks: a Q4_1 file's weights,
  dequantized on load, quantize back to the very same values (up to float rounding of the scales).
  The LM head takes int8 (as a GGUF file's Q8_0 output table), not int4.

Where the dense path pays, batched steps and prefill (`dense_min_rows()` rows or more) multiply by a
dense copy of the dequantized weights in the model dtype, so the model keeps both: with AVX512-BF16
(the bf16 GEMM, AMX's above all, beats the weight-only kernels from a few rows on). Where pdserve's
int4 kernel multiplies in fp32 (AVX2 + FMA + F16C, or AVX-512 without BF16), it beats torch's fp32
GEMM up to ~56 rows, and beyond, dequantizing each projection into a scratch just before torch's GEMM
(`int4_unpack_t_`) matches a dense copy: so no dense copy is kept, few rows run the int4 kernel, and
from `UNPACK_MIN_ROWS` rows (big decode batches, prefill) the scratch. The int8 modules likewise keep no dense copy there (their
kernel runs at any row count). `dense_plan()` says which applies on this host. The embedding table
stays in the model dtype (a row lookup, not a matmul); a tied LM head gets its own int8 copy, which the
embedding then reads too where no dense copy is kept (`PackedInt8Embedding`). Norms,
rotary and attention are untouched. CPU only: torch's packed kernels here are its CPU ones (a CUDA
weight-only GEMM is not built yet), so a CUDA device is refused with a message.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import QUANT_MODES
from pdserve.kernels import cpu_quant_linear
from pdserve.runtime.host import cpu_has_amx, cpu_has_int8_dot
from pdserve.runtime.models.llama import CausalLM

__all__ = ["QUANT_MODES", "QuantizationError", "check_quantization", "quantize_model"]
INT4_GROUP_SIZE = 32
# Below this many rows w8a8 runs the weight-only int8 kernel (see the module docstring).
W8A8_MIN_ROWS = 8
# Hosts whose int4 kernel multiplies in bf16 (AVX512-BF16): from this many rows every mode multiplies
# by a dense copy of the dequantized weights in the model dtype: torch's weight-only kernels are built
# for the memory-bound few-row case, and their time grows with the rows while a bf16 GEMM's hardly
# does. Measured as whole decode steps of the bundled model (w4a16, bf16, 2 threads, Xeon Sapphire
# Rapids class with AMX; both thresholds interleaved in one process, best of 3): at 6 rows 36.5 ms int4
# against 40.7 dense, at 8 rows 36.5 against 39.3, at 9 rows 53.3 against 42.8 (the int4 kernel's time
# jumps between 8 and 9 rows), at 12 rows 50.3 against 42.0, at 14 rows 61.9 against 49.2. Single
# projections on a hot cache put the crossover at 5 rows, but a whole step streams 4x more bytes of
# bf16 weights than of int4 ones. `_int_mm` with its activation quantization (w8a8) loses to the AMX
# bf16 GEMM too (gate_up 231 against 178 us at 8 rows). Without AMX the bf16 GEMM is several times
# slower and 16 is kept (a batch-16 step measured on the same Xeon: bf16 58 ms, w8a8 58, w4a16 78,
# w8a16 86).
DENSE_MIN_ROWS_AMX = 9
DENSE_MIN_ROWS = 16
# Hosts whose int4 kernel multiplies in fp32 (AVX2): no dense copy. A decode step's 120 projections of
# the bundled model, weights streamed from memory (`pdserve bench cpu`, 2 threads, AMD EPYC AVX2-only,
# best of 5): the int4 kernel 5.3 ms at 1 row, 37.7 at 16, 146 at 64; torch's fp32 GEMM on dense weights
# 35.0, 55.8, 122; dequantizing each projection into a scratch before that GEMM 25.4, 72.1, 140. So few
# rows take the kernel, and from about 56 rows (where the lines cross) the scratch; no dense copy pays
# for its memory (540 MB in fp32).
UNPACK_MIN_ROWS = 56
# w4a8's integer kernel against the same GEMM (same host, same bench, while the machine was shared, so
# noisy): 4.2 / 15.8 / 73.0 / 236 ms at 1 / 16 / 64 / 256 rows against 39.0 / 64.8 / 158 / 475 for the
# fp32 GEMM and 36.9 / 90.2 / 177 / 510 for the scratch: no crossover, so w4a8 keeps the kernel throughout.
A8_ROWS_MEASURED = 256


@dataclass(frozen=True)
class DensePlan:
    """How this host's quantized linears multiply many rows: `keep` a dense copy (used from
    `min_rows` rows), or keep none and dequantize into a scratch from `min_rows` rows; `why` for the
    start-up line."""

    keep: bool
    min_rows: int
    why: str


def dense_plan() -> DensePlan:
    """The plan for this host (its flags under the PDSERVE_CPU_ISA cap, and its kernel build)."""
    int4, _ = cpu_quant_linear.support()
    if int4 and not cpu_quant_linear.int4_in_bf16():
        return DensePlan(False, UNPACK_MIN_ROWS, "the fp32 int4 kernel beats the fp32 GEMM below that")
    if cpu_has_amx():
        return DensePlan(True, DENSE_MIN_ROWS_AMX, "AMX bf16 GEMM from 9 rows")
    return DensePlan(True, DENSE_MIN_ROWS, "dense GEMM from 16 rows")


def a8_multiplies_faster() -> bool:
    """Whether w4a8's integer kernel beats w4a16's here: where the int4 kernel multiplies in fp32 (AVX2, or
    AVX-512 without BF16) and the build has `int4_linear_a8` (see A8_ROWS_MEASURED)."""
    return cpu_quant_linear.int4_a8_support() and not cpu_quant_linear.int4_in_bf16()


def dense_min_rows() -> int:
    """The row count from which this host's quantized linears take their dense path (see above)."""
    return dense_plan().min_rows


class QuantizationError(ValueError):
    pass


def check_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with the reason named, a mode this host or dtype cannot run."""
    if mode not in QUANT_MODES:
        raise QuantizationError(f"unknown --quantization {mode!r}; choose {', '.join(QUANT_MODES)}")
    if mode == "none":
        return
    if device.type != "cpu":
        raise QuantizationError(
            f"--quantization {mode} runs on CPU only (torch's packed int8/int4 kernels); "
            f"on {device.type} use --quantization none"
        )
    if dtype == torch.float16:
        raise QuantizationError(f"--quantization {mode} takes --dtype bfloat16 or float32 activations")


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of w [N, K] with one fp32 scale per row: (q [N, K] int8, scale [N])."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


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
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, invariant: bool = False
    ):
        super().__init__()
        q, scale = int8_per_channel(weight)
        n = weight.shape[0]
        fast = cpu_quant_linear.support()[1] and n % cpu_quant_linear.ROWS == 0
        plan = dense_plan()
        # batch-invariant (`invariant`): the kernel at every row count, so no dense copy
        keep_dense = not fast or (plan.keep and not invariant)
        self.register_buffer("qweight", q if self.keeps_codes or not fast else None)  # [N, K] int8
        self.register_buffer("scale", scale.to(dtype))  # [N], the activation dtype (the kernel's rule)
        self.register_buffer("scale_f32", self.scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.register_buffer("dense", (q.float() * scale[:, None]).to(dtype) if keep_dense else None)
        self.register_buffer("packed", cpu_quant_linear.pack_int8(q) if fast else None)
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
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, invariant: bool = False
    ):
        super().__init__(weight, bias, dtype, invariant)
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
        plan = dense_plan()
        if fast:
            self.register_buffer("packed", cpu_quant_linear.pack_int4(q, scale, lo))
            self.register_buffer("scales_zeros", None)
        else:
            # The kernel's zero point is the value of the code 8: minimum + 8 * scale.
            sz = torch.stack([scale, lo + 8 * scale], dim=-1)  # [N, K/g, 2]
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # bf16 whatever the model dtype: the kernel's fp32 path is a slow reference loop (measured
            # 15-50x slower), so fp32 activations are cast to bf16 for the matmul and back.
            self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        # w4a8: int8 activations where the build has that kernel (cpu_quant_linear.int4_a8_support)
        self.act8 = act8 and fast and cpu_quant_linear.int4_a8_support()
        self.bind_ops()
        dense = None
        if not fast or (plan.keep and not invariant):
            dense = (q.reshape(n, k // group, group).float() * scale[..., None] + lo[..., None]).reshape(n, k)
        self.register_buffer("dense", None if dense is None else dense.to(dtype))
        self.group = group
        self.in_features, self.out_features = k, n
        # The kernel at every row count: batch-invariant, or w4a8 without a dense copy (see the module
        # docstring). Elsewhere a dense copy or a scratch from `plan.min_rows` rows on.
        self.invariant = invariant and fast
        every_row = self.invariant or (self.act8 and dense is None)
        self.dense_min_rows = sys.maxsize if every_row else plan.min_rows

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


def quantized_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dtype: torch.dtype, invariant: bool = False
) -> nn.Module:
    """The quantized stand-in for a Linear with this weight [N, K] (and bias) under `mode`; `invariant`:
    batch-invariant, pdserve's kernel at every row count (runtime/determinism.py)."""
    if mode == "w8a16_int8":
        return Int8WeightOnlyLinear(weight, bias, dtype, invariant)
    if mode == "w8a8_int8":
        return Int8DynamicLinear(weight, bias, dtype, invariant)
    if mode in ("w4a16", "w4a8"):
        return Int4WeightOnlyLinear(
            weight, bias, dtype, INT4_GROUP_SIZE, act8=mode == "w4a8", invariant=invariant
        )
    raise QuantizationError(f"no quantized linear for mode {mode!r}")


def head_mode(mode: str) -> str:
    """The LM head's mode: int8 under w4a16 and w4a8 (a 4-bit head costs accuracy for little speed)."""
    return "w8a16_int8" if mode in ("w4a16", "w4a8") else mode


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_model(model: CausalLM, mode: str, dtype: torch.dtype, invariant: bool = False) -> int:
    """Replace, in place, every decoder projection (PROJECTIONS) by its quantized module, and give
    the model a quantized LM head (`lm_head_quant`). Returns the number of replaced Linears.
    `invariant`: every module runs pdserve's kernel at every row count, where it can (`all_invariant`)."""
    if mode == "none":
        return 0
    count = 0
    for parent in list(model.modules()):
        for name in PROJECTIONS:
            lin = getattr(parent, name, None)
            if isinstance(lin, nn.Linear):
                setattr(parent, name, quantized_linear(lin.weight.data, lin.bias, mode, dtype, invariant))
                count += 1
    head_weight = model.lm_head_weight
    head = model.lm_head_quant = quantized_linear(head_weight.data, None, head_mode(mode), dtype, invariant)
    # A tied table whose head keeps only packed codes: the embedding reads them too.
    if (
        model.lm_head is None
        and type(head) is Int8WeightOnlyLinear
        and head.packed is not None
        and head.dense is None
    ):
        model.model.embed_tokens = PackedInt8Embedding(head, dtype)
    mark_quantized(model)
    return count


def mark_quantized(model: CausalLM) -> None:
    """A quantized model is no exactness reference: its fp32 forwards take the C++ fused ops and the
    one-call decode layer too (runtime/models/norm_rope.py, `cpu_fused`)."""
    for m in model.modules():
        if hasattr(m, "fused_fp32"):
            setattr(m, "fused_fp32", True)  # noqa: B010 (any module that has the attribute)


def all_invariant(model: CausalLM) -> bool:
    """Whether every linear of the model is a quantized module running pdserve's kernel at every row
    count (a plain Linear, or one left on torch's packed kernels, is not batch-invariant)."""
    # an untied LM head stays a Linear beside its quantized copy (`lm_head_quant`), which the forward takes
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]
    quantized = [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear | Int4WeightOnlyLinear)]
    return bool(quantized) and not linears and all(bool(getattr(m, "invariant", False)) for m in quantized)
