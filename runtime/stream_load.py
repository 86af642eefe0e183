"""Building a model from its checkpoint one tensor at a time, each projection quantized (or cast) as soon
as its parts are read, so that a load never holds a whole-model float copy.

The model is made on the meta device; each layer's norms and projections are then read from a
TensorReader (runtime/weight_readers.py) and put in place. A projection is built straight in its final
form: an nn.Linear in the model dtype (`--quantization none`), pdserve's packed int4 module from the
GGUF file's own 4-bit blocks (`Int4WeightOnlyLinear.from_packed`, no float copy at all), or a quantized
module of the float weights (runtime/quant.py) for any other source. So the peak of a load is the
model as kept plus the float parts of one fused projection (gate and up of the largest layer), which
tests/runtime/test_stream_load_memory.py holds it to.

What a fused projection is made of when its parts differ (a Q4_K_M file's q and k in Q4_K, its v in
Q6_K): the 4-bit parts are repacked exactly, a wider part is rounded to 4 bits in groups of 32 (min/max,
as `--quantization w4a16` rounds any checkpoint), and the rows are joined packed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from pdserve.kernels import cpu_quant_linear
from pdserve.progress import progress
from pdserve.runtime import quant
from pdserve.runtime.model_config import ModelSpec
from pdserve.runtime.models.llama import CausalLM, DecoderLayer
from pdserve.runtime.weight_readers import TensorReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildPlan:
    device: torch.device
    dtype: torch.dtype
    mode: str  # runtime/quant.py's --quantization mode, resolved
    invariant: bool = False  # batch-invariant modules (runtime/determinism.py)
    dense_allowed: bool = True  # quant_plan.dense_copies_fit


def projection_params(spec: ModelSpec) -> int:
    """The parameters of every decoder projection and the head: what dense copies would hold."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = (
        spec.hidden_size * (q + 2 * kv) + q * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size
    )
    return spec.num_layers * per_layer + spec.vocab_size * spec.hidden_size


def _param(t: torch.Tensor, plan: BuildPlan) -> nn.Parameter:
    return nn.Parameter(t.to(device=plan.device, dtype=plan.dtype), requires_grad=False)


def _fused_float(
    reader: TensorReader, names: list[str], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The parts stacked by rows into one new tensor, each part read and copied in turn."""
    shapes = [reader.shape(name) for name in names]
    out = torch.empty(sum(s[0] for s in shapes), shapes[0][1], dtype=dtype, device=device)
    row = 0
    for name, shape in zip(names, shapes, strict=True):
        out[row : row + shape[0]].copy_(reader.tensor(name))
        row += shape[0]
    return out


def _projection(reader: TensorReader, bases: list[str], bias: bool, plan: BuildPlan) -> nn.Module:
    """The fused projection of checkpoint tensors `bases` (+ ".weight", + ".bias" where `bias`)."""
    names = [f"{b}.weight" for b in bases]
    b = torch.cat([reader.tensor(f"{x}.bias").float() for x in bases]) if bias else None
    if plan.mode in ("w4a16", "w4a8") and cpu_quant_linear.support()[0]:
        parts = []
        for name in names:
            part = reader.packed_int4(name)
            if part is None:
                break
            parts.append(part)
        else:
            packed = parts[0] if len(parts) == 1 else torch.cat(parts)
            del parts
            return quant.Int4WeightOnlyLinear.from_packed(
                packed, b, plan.dtype, plan.mode == "w4a8", plan.invariant, plan.dense_allowed
            )
    if plan.mode != "none":
        w = _fused_float(reader, names, torch.float32, torch.device("cpu"))
        return quant.quantized_linear(w, b, plan.mode, plan.dtype, plan.invariant, plan.dense_allowed)
    w = _fused_float(reader, names, plan.dtype, plan.device)
    with torch.device("meta"):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    lin.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        lin.bias = _param(b, plan)
    return lin


def _build_layer(layer: DecoderLayer, reader: TensorReader, spec: ModelSpec, plan: BuildPlan) -> None:
    p = f"model.layers.{layer.layer_id}."
    layer.input_layernorm.weight = _param(reader.tensor(p + "input_layernorm.weight"), plan)
    layer.post_attention_layernorm.weight = _param(reader.tensor(p + "post_attention_layernorm.weight"), plan)
    attn, mlp = layer.self_attn, layer.mlp
    if spec.qk_norm:
        attn.q_norm.weight = _param(reader.tensor(p + "self_attn.q_norm.weight"), plan)
        attn.k_norm.weight = _param(reader.tensor(p + "self_attn.k_norm.weight"), plan)
    qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
    # setattr: the modules' declared type is nn.Linear, a quantized module takes its place
    setattr(attn, "qkv_proj", _projection(reader, qkv, spec.qkv_bias, plan))  # noqa: B010
    setattr(attn, "o_proj", _projection(reader, [p + "self_attn.o_proj"], False, plan))  # noqa: B010
    setattr(mlp, "gate_up_proj", _projection(reader, [p + "mlp.gate_proj", p + "mlp.up_proj"], False, plan))  # noqa: B010
    setattr(mlp, "down_proj", _projection(reader, [p + "mlp.down_proj"], False, plan))  # noqa: B010


def _build_ends(model: CausalLM, reader: TensorReader, spec: ModelSpec, plan: BuildPlan) -> None:
    """The embedding, the final norm and the LM head (quantized to int8 under a quantized mode; a tied
    table whose head keeps only packed codes is then read from them, as runtime/quant.py does)."""
    model.model.norm.weight = _param(reader.tensor("model.norm.weight"), plan)
    table = reader.tensor("model.embed_tokens.weight")
    if plan.mode == "none":
        model.model.embed_tokens.weight = _param(table, plan)
        if model.lm_head is not None:
            model.lm_head.weight = _param(reader.tensor("lm_head.weight"), plan)
        return
    head_mode = quant.head_mode(plan.mode)
    source = table if spec.tie_word_embeddings else reader.tensor("lm_head.weight")
    head = quant.quantized_linear(
        source.float(), None, head_mode, plan.dtype, plan.invariant, plan.dense_allowed
    )
    del source
    model.lm_head_quant = head
    model.lm_head = None  # the float head is never read under quantization (weight updates refuse it)
    if spec.tie_word_embeddings and type(head) is quant.Int8WeightOnlyLinear and head.dense is None:
        if head.packed is not None:
            model.model.embed_tokens = quant.PackedInt8Embedding(head, plan.dtype)
            return
    model.model.embed_tokens.weight = _param(table, plan)


def build_model(spec: ModelSpec, reader: TensorReader, plan: BuildPlan, what: str) -> CausalLM:
    """The model of `spec` with `reader`'s weights in their final form (see the module docstring)."""
    t0 = time.monotonic()
    missing = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.down_proj.weight"}
    if not spec.tie_word_embeddings:
        missing.add("lm_head.weight")
    missing -= reader.names()
    if missing:
        raise ValueError(f"{what} lacks tensors, e.g. {sorted(missing)[:3]}")
    with torch.device("meta"):
        model = CausalLM(spec, rotary=None)  # type: ignore[arg-type]
    layers = cast("list[DecoderLayer]", list(model.model.layers))
    try:
        for layer in progress(layers, len(layers), f"loading {what}", log.info, unit="layers"):
            _build_layer(layer, reader, spec, plan)
        _build_ends(model, reader, spec, plan)
    except KeyError as e:
        raise ValueError(f"{what} lacks tensor {e.args[0]!r}") from None
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{what} left {len(left)} tensors unset, e.g. {left[:3]}")
    if plan.mode != "none":
        quant.mark_quantized(model)
    log.info("loaded %s in %.1f s (%s, %s)", what, time.monotonic() - t0, plan.mode, plan.dtype)
    return model
