"""The shapes of real models, and the tensors each one holds, for random-weight files of real sizes.

A benchmark of loading, memory or decode speed measures bytes and matrix shapes, not what the weights
say; these shapes let `pdserve bench write-model` write files as large as the real ones without a
download. Every shape uses the bundled tokenizer, so its vocabulary is 49152 whatever the real model's
is (Llama 3.1's 128256 and Qwen2.5's 152064 would add 0.6 and 0.8 GB of embeddings at bf16).

The tensor list is the one both formats share: GGUF's names (as llama.cpp's converter writes them) and
the Hugging Face names of the same tensors, in the converter's order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    arch: str  # "llama" or "qwen2": GGUF's general.architecture, and the HF model class
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 49152
    tied: bool = False  # the output head shares token_embd (no output.weight / lm_head.weight)
    qkv_bias: bool = False  # Qwen2's biases on q, k and v
    rope_theta: float = 10000.0
    context: int = 8192
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("llama", 30, 576, 1536, 9, 3, tied=True, rope_theta=100000.0),
    "smollm2-1.7b": ModelShape("llama", 24, 2048, 8192, 32, 32, tied=True, rope_theta=130000.0),
    # Llama 3.1's RoPE scaling (llama.cpp's rope_freqs tensor) is left out: it changes no size or speed.
    "llama-3.1-8b": ModelShape("llama", 32, 4096, 14336, 32, 8, rope_theta=500000.0, context=131072),
    "qwen2.5-7b": ModelShape(
        "qwen2", 28, 3584, 18944, 28, 4, qkv_bias=True, rope_theta=1000000.0, context=32768, rms_eps=1e-6
    ),
    # For tests: every row length a multiple of 256, so each GGUF block type fits without a fallback.
    "tiny": ModelShape("llama", 2, 256, 512, 4, 2, context=2048),
    "tiny-qwen2": ModelShape("qwen2", 2, 256, 512, 4, 2, qkv_bias=True, context=2048, rms_eps=1e-6),
}


@dataclass(frozen=True)
class TensorSpec:
    gguf_name: str
    hf_name: str
    rows: int  # out features (vocab for the embeddings); 1 for a vector
    cols: int  # in features: the row GGUF quantizes block by block
    role: str  # "token_embd", "output", "attn_q"... (GGUF's name without blk.N.), "norm" or "bias"
    layer: int = -1  # -1 outside the blocks

    @property
    def is_vector(self) -> bool:
        return self.role in ("norm", "bias")

    @property
    def numel(self) -> int:
        return self.rows * self.cols


_ATTN = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj"}


def _block(shape: ModelShape, i: int) -> list[TensorSpec]:
    hd, kv = shape.head_dim, shape.kv_heads * shape.head_dim
    g, h = f"blk.{i}.", f"model.layers.{i}."
    out_rows = {"attn_q": shape.heads * hd, "attn_k": kv, "attn_v": kv}
    specs = [TensorSpec(g + "attn_norm.weight", h + "input_layernorm.weight", 1, shape.hidden, "norm", i)]
    for role, proj in _ATTN.items():
        specs.append(
            TensorSpec(
                f"{g}{role}.weight", f"{h}self_attn.{proj}.weight", out_rows[role], shape.hidden, role, i
            )
        )
        if shape.qkv_bias:
            specs.append(
                TensorSpec(f"{g}{role}.bias", f"{h}self_attn.{proj}.bias", 1, out_rows[role], "bias", i)
            )
    return specs + [
        TensorSpec(
            g + "attn_output.weight",
            h + "self_attn.o_proj.weight",
            shape.hidden,
            shape.heads * hd,
            "attn_output",
            i,
        ),
        TensorSpec(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1, shape.hidden, "norm", i),
        TensorSpec(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", shape.ffn, shape.hidden, "ffn_gate", i),
        TensorSpec(g + "ffn_up.weight", h + "mlp.up_proj.weight", shape.ffn, shape.hidden, "ffn_up", i),
        TensorSpec(g + "ffn_down.weight", h + "mlp.down_proj.weight", shape.hidden, shape.ffn, "ffn_down", i),
    ]


def tensor_specs(shape: ModelShape) -> list[TensorSpec]:
    """Every tensor of the model, embeddings first, then the blocks, the final norm and the head."""
    specs = [
        TensorSpec("token_embd.weight", "model.embed_tokens.weight", shape.vocab, shape.hidden, "token_embd")
    ]
    for i in range(shape.layers):
        specs += _block(shape, i)
    specs.append(TensorSpec("output_norm.weight", "model.norm.weight", 1, shape.hidden, "norm"))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", "lm_head.weight", shape.vocab, shape.hidden, "output"))
    return specs
