"""Batch-invariant decoding (`--deterministic auto|on|off`): a request's tokens do not depend on the
batch it shares a step with, on how its prompt was chunked, on a prefix-cache hit, a retraction or a
migration.

Two things make a forward's value for one token depend on its neighbours, and both are avoided:
- a linear whose kernel or reduction order changes with the row count (a dense GEMM from some row
  count on, a scratch, `_int_mm` for w8a8). Batch-invariant, every quantized projection and the LM head
  run pdserve's kernel at every row count (kernels/cpu_quant_linear.cpp: each output is one chain of
  FMAs over the groups in a fixed order, whatever the tile of rows it is computed in) and keep no dense
  copy. torch's float GEMM picks its kernel by the row count, so an unquantized model is not invariant.
- attention computed one way for a prompt (SDPA / flash, blocked over the queries) and another for a
  decode step. Batch-invariant, every query, of a prompt, a chunk, a verify or a decode step, is one
  row of the C++ paged decode attention (kernels/cpu_decode_attention.cpp) over its own pool rows,
  its own key included (runtime/attention_cpu.py).
Norms, rotary, SiLU, the embedding and the greedy argmax are per row already.

`auto` turns it on where it costs nothing measurable: where the int4 kernel multiplies in fp32 (no
dense copy is kept) and the mode's kernel already runs at every row count (w4a8 with its integer
kernel, w8a16_int8). Elsewhere the dense copies (AMX, AVX512-BF16) or the scratch (w4a16 from 56 rows)
are what make batches fast, and `on` trades that speed for invariance (docs/reliability.md measures it).
"""

from __future__ import annotations

import torch

from pdserve.config import DETERMINISTIC_CHOICES
from pdserve.kernels import cpu_quant_linear
from pdserve.runtime.quant import dense_plan, head_mode

__all__ = ["DeterminismError", "resolve_batch_invariance"]


class DeterminismError(ValueError):
    pass


def _obstacle(mode: str, device: torch.device, attention_backend: str) -> str | None:
    """Why batch invariance cannot be had in this configuration, or None."""
    if device.type != "cpu":
        return f"the batch-invariant kernels are CPU ones (this worker runs on {device.type})"
    if mode == "none":
        return (
            "it needs a quantized model (--quantization w4a8, w4a16, w8a16_int8 or w8a8_int8): torch's "
            "float GEMM picks its kernel by the row count"
        )
    if attention_backend not in ("auto", "cpu"):
        return f"it needs --attention-backend cpu (not {attention_backend})"
    from pdserve.kernels import cpu_decode_attention

    if not cpu_decode_attention.load():
        return "the C++ paged attention kernel could not be built on this host"
    int4, int8 = cpu_quant_linear.support()
    needs_int4 = mode in ("w4a16", "w4a8")
    needs_int8 = "int8" in mode or "int8" in head_mode(mode)
    if (needs_int4 and not int4) or (needs_int8 and not int8):
        return "this host's kernel build lacks pdserve's quantized kernels (AVX2 + FMA + F16C at least)"
    return None


def already_invariant(mode: str) -> bool:
    """Whether the mode's modules run their kernel at every row count here anyway (no dense copy, no
    scratch, no `_int_mm`): then invariance costs nothing in the linears."""
    if dense_plan().keep:
        return False
    if mode == "w8a16_int8":
        return True
    return mode == "w4a8" and cpu_quant_linear.int4_a8_support()


def resolve_batch_invariance(
    flag: str, mode: str, device: torch.device, attention_backend: str
) -> tuple[bool, str]:
    """(on, why) for `--deterministic` under quantization `mode` (resolved) on `device`."""
    if flag not in DETERMINISTIC_CHOICES:
        raise DeterminismError(f"unknown --deterministic {flag!r}; choose {', '.join(DETERMINISTIC_CHOICES)}")
    if flag == "off":
        return False, "--deterministic off"
    problem = _obstacle(mode, device, attention_backend)
    if flag == "on":
        if problem is not None:
            raise DeterminismError(f"--deterministic on: {problem}")
        return True, "--deterministic on"
    if problem is not None:
        return False, f"auto: off, {problem}"
    if already_invariant(mode):
        return True, f"auto: on, {mode}'s kernels run at every batch size on this host"
    return False, (
        f"auto: off, {mode} takes a faster path for batches on this host; --deterministic on trades it for "
        "invariance"
    )
