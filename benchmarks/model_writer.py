"""`pdserve bench write-model`: random-weight model files of real shapes, so that benchmarks of loading,
memory and speed measure real sizes without downloading a model.

    pdserve bench write-model --shape llama-3.1-8b --quant q4_k_m --out llama-8b.Q4_K_M.gguf
    pdserve bench write-model --shape smollm2-1.7b --format safetensors --dtype bfloat16 --out folder/

A GGUF file is written tensor by tensor (GGUFWriter's tensor infos first, then each tensor's data as it
is made), so an 8B file never sits whole in memory; its blocks are random bytes with valid headers
(gguf_blocks.py), not quantized floats, which is what makes a 4.5 GB file take seconds. The metadata
carries the architecture's real keys and every tokenizer.* key of the bundled model, so llama.cpp and
transformers load the file as they would a converted one. A safetensors folder is a Hugging Face
checkpoint (config.json, ~2 GB shards and their index, the bundled tokenizer's files), written shard
by shard. Shapes are in model_shapes.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

from pdserve.bench.gguf_blocks import constant_vector, random_tensor, row_bytes
from pdserve.bench.gguf_metadata import read_metadata
from pdserve.bench.model_shapes import SHAPES, ModelShape, TensorSpec, tensor_specs

Q = GGMLQuantizationType
# --quant -> (the type of every weight matrix, general.file_type); q4_k_m picks per tensor (mixed_type).
QUANTS: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (Q.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q4_k": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "q5_k": (Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "q6_k": (Q.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "q4_k_m": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
}
# llama-quant's fallbacks for a row that is no whole number of 256-weight blocks (SmolLM2-135M's 576).
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
SHARD_BYTES = 2_000_000_000


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama-quant's choice of the layers that get more bits: the first and last eighths, and every third
    layer between them."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _q4_k_m_type(spec: TensorSpec, shape: ModelShape) -> GGMLQuantizationType:
    """llama.cpp's Q4_K_M mix: the head (or, when tied, token_embd, which is the head too) Q6_K (Q8_0 when
    its rows are no whole number of 256-blocks), attn_v and ffn_down Q6_K in the use-more-bits layers,
    every other matrix Q4_K."""
    if spec.role == "output" or (spec.role == "token_embd" and shape.tied):
        return Q.Q6_K if spec.cols % 256 == 0 else Q.Q8_0
    if spec.role in ("attn_v", "ffn_down") and _use_more_bits(spec.layer, shape.layers):
        return Q.Q6_K
    return Q.Q4_K


def tensor_type(spec: TensorSpec, shape: ModelShape, quant: str) -> GGMLQuantizationType:
    """The GGUF type a tensor is written in: vectors F32; matrices by `quant`, falling back as llama-quant
    does when a row does not split into the type's blocks."""
    if spec.is_vector:
        return Q.F32
    qtype = _q4_k_m_type(spec, shape) if quant == "q4_k_m" else QUANTS[quant][0]
    if spec.cols % 256 and qtype in _FALLBACK:
        qtype = _FALLBACK[qtype]
    return qtype


def _add_metadata(writer: GGUFWriter, shape: ModelShape, quant: str, name: str) -> None:
    from pdserve.model_source import resolve_model_source

    writer.add_name(name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(QUANTS[quant][1])
    writer.add_quantization_version(2)
    bundled = resolve_model_source(None).gguf_path
    assert bundled is not None, "the bundled model is a GGUF file"
    for key, value, vtype, sub in read_metadata(bundled, "tokenizer."):
        writer.add_key_value(key, value, vtype, sub_type=sub)


def _tensor_bytes(spec: TensorSpec, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if spec.role == "norm":
        return constant_vector(1.0, spec.cols)
    data = random_tensor(rng, qtype, spec.rows, spec.cols)
    return data.reshape(-1) if spec.is_vector else data


def write_gguf(path: str, shape: ModelShape, quant: str, seed: int = 0) -> str:
    """Write a random-weight GGUF file of `shape` in `quant` (a key of QUANTS) to `path`; returns `path`.

    Each tensor has its own random stream (seeded by `seed` and its index), so a file is the same
    whatever order or thread made it."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}: one of {', '.join(QUANTS)}")
    specs = tensor_specs(shape)
    types = [tensor_type(s, shape, quant) for s in specs]
    writer = GGUFWriter(path, shape.arch)
    _add_metadata(writer, shape, quant, os.path.splitext(os.path.basename(path))[0])
    for spec, qtype in zip(specs, types):
        nbytes = spec.rows * row_bytes(qtype, spec.cols)
        byte_shape = (nbytes,) if spec.is_vector else (spec.rows, nbytes // spec.rows)
        writer.add_tensor_info(spec.gguf_name, byte_shape, np.dtype(np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (spec, qtype) in enumerate(zip(specs, types)):
        writer.write_tensor_data(_tensor_bytes(spec, qtype, np.random.default_rng([seed, i])))
    writer.close()
    return path


def _hf_config(shape: ModelShape, dtype: str, bos: int, eos: int):  # -> transformers.PretrainedConfig
    import transformers

    if shape.qkv_bias != (shape.arch == "qwen2"):
        raise ValueError("transformers' Llama has no q/k/v-only biases and its Qwen2 always has them")
    cls = transformers.Qwen2Config if shape.arch == "qwen2" else transformers.LlamaConfig
    config = cls(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=shape.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tied,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    config.architectures = ["Qwen2ForCausalLM" if shape.arch == "qwen2" else "LlamaForCausalLM"]
    config.dtype = dtype
    return config


def _shards(specs: list[TensorSpec], itemsize: int) -> list[list[TensorSpec]]:
    """The tensors split, in order, into shards of at most SHARD_BYTES (a larger tensor alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _hf_tensor(spec: TensorSpec, dtype, generator):  # -> torch.Tensor
    import torch

    shape = (spec.cols,) if spec.is_vector else (spec.rows, spec.cols)
    if spec.role == "norm":
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(dtype)


def write_safetensors(folder: str, shape: ModelShape, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Write a random-weight Hugging Face checkpoint of `shape` to `folder`; returns `folder`.

    Weights are normal with std 0.02 (norms one), one shard at a time: the whole model is never in
    memory. One shard is model.safetensors, more are model-0000X-of-0000Y.safetensors and their index,
    as save_pretrained names them."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from pdserve.model_source import resolve_model_source

    torch_dtype = getattr(torch, dtype)
    os.makedirs(folder, exist_ok=True)
    source = resolve_model_source(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    tokenizer.save_pretrained(folder)
    _hf_config(shape, dtype, tokenizer.bos_token_id, tokenizer.eos_token_id).save_pretrained(folder)
    shards = _shards(tensor_specs(shape), torch_dtype.itemsize)
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for n, specs in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {s.hf_name: _hf_tensor(s, torch_dtype, generator) for s in specs}
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return folder


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench write-model", description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=list(SHAPES))
    p.add_argument("--format", default="gguf", choices=["gguf", "safetensors"])
    p.add_argument("--quant", default="q4_k_m", choices=list(QUANTS), help="GGUF only")
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="safetensors only"
    )
    p.add_argument("--out", required=True, help="the .gguf file, or the safetensors folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    start = time.perf_counter()
    if args.format == "gguf":
        write_gguf(args.out, shape, args.quant, args.seed)
    else:
        write_safetensors(args.out, shape, args.dtype, args.seed)
    seconds = time.perf_counter() - start
    size = _size(args.out)
    print(f"{args.out}: {size / 1e6:.1f} MB in {seconds:.1f} s ({size / 1e6 / seconds:.0f} MB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
