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

This module replaces a model's linears; the modules themselves are in quant_int8.py and quant_int4.py,
and the host's plan (dense copies, row crossovers, the modes it can run) in quant_plan.py.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.config import QUANT_MODES
from pdserve.runtime.models.llama import CausalLM
from pdserve.runtime.quant_int4 import INT4_GROUP_SIZE, Int4WeightOnlyLinear
from pdserve.runtime.quant_int8 import Int8DynamicLinear, Int8WeightOnlyLinear, PackedInt8Embedding
from pdserve.runtime.quant_plan import QuantizationError, a8_multiplies_faster, check_quantization, dense_plan

__all__ = [
    "QUANT_MODES",
    "QuantizationError",
    "check_quantization",
    "quantize_model",
    # the modules and the host's plan (quant_int8.py, quant_int4.py, quant_plan.py), for the callers
    # that take them from here with the rest (the loader, the runner, the quantized model's cache)
    "Int4WeightOnlyLinear",
    "Int8DynamicLinear",
    "Int8WeightOnlyLinear",
    "PackedInt8Embedding",
    "a8_multiplies_faster",
    "dense_plan",
]


def quantized_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    dtype: torch.dtype,
    invariant: bool = False,
    dense_allowed: bool = True,
) -> nn.Module:
    """The quantized stand-in for a Linear with this weight [N, K] (and bias) under `mode`; `invariant`:
    batch-invariant, pdserve's kernel at every row count (runtime/determinism.py); `dense_allowed`: False
    for a model too big for dense copies (quant_plan.dense_copies_fit)."""
    if mode == "w8a16_int8":
        return Int8WeightOnlyLinear(weight, bias, dtype, invariant, dense_allowed)
    if mode == "w8a8_int8":
        return Int8DynamicLinear(weight, bias, dtype, invariant, dense_allowed)
    if mode in ("w4a16", "w4a8"):
        return Int4WeightOnlyLinear(
            weight, bias, dtype, INT4_GROUP_SIZE, mode == "w4a8", invariant, dense_allowed
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
