"""One decoder layer of a CPU decode step in one operator call (cpu_decode_layer.cpp).

The eager bf16 / fp16 CPU layer is ~16 operator calls, each a few microseconds of Python and dispatch:
at batch 1 on 2 cores they add up to ~2 ms of a ~7 ms step with the int4 kernel's weight reads. The
C++ operator makes the same calls, in the same order, through the dispatcher, so it gives the eager
layer's values exactly; the eager layer (runtime/models/llama.py) is its reference. It runs where every
projection is a plain linear or a w4a16 linear with pdserve's int4 kernel, the layer has no per-head
q/k norm, and the attention is the CPU backend's paged decode (runtime/attention_cpu.py); elsewhere
the model keeps its eager layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.cpu_library import load

__all__ = ["DecodeAttention", "LayerWeights", "decode_layer", "load"]


@dataclass(frozen=True)
class LayerWeights:
    """A layer's tensors as the operator takes them. A projection is [weight] (plain linear) or
    [dense, packed] (w4a16: packed int4 below `dense_min_rows` rows, the dense copy from there on)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: list[torch.Tensor]
    qkv_bias: torch.Tensor | None
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    dense_min_rows: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    act8: bool = False  # w4a8: the packed projections multiply int8 activations (int4_linear_a8)


@dataclass(frozen=True)
class DecodeAttention:
    """One layer's view of a decode batch in the KV pool (CpuAttention.decode_args)."""

    rows: torch.Tensor
    key_rows: torch.Tensor
    lens: torch.Tensor
    k_offset: int
    v_offset: int
    new_rows: torch.Tensor


def decode_layer(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: LayerWeights,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    a: DecodeAttention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mlp_out, residual) of the layer, as `DecoderLayer.forward`; `load()` must have returned True."""
    out, res = torch.ops.pdserve_cpu.decode_layer(
        x,
        residual,
        w.in_norm,
        w.post_norm,
        w.eps,
        w.qkv,
        w.qkv_bias,
        w.o,
        w.gate_up,
        w.down,
        w.dense_min_rows,
        w.num_heads,
        w.num_kv_heads,
        w.head_dim,
        positions,
        cos,
        sin_signed,
        a.rows,
        a.key_rows,
        a.lens,
        a.k_offset,
        a.v_offset,
        w.scale,
        a.new_rows,
        w.act8,
    )
    return out, res
