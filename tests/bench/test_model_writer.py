"""`pdserve bench write-model`: random-weight files of real shapes that readers take for real ones.

Every GGUF type is written for the tiny shape and read back (types, shapes, metadata, the bundled
tokenizer's keys), and transformers loads each file and gives finite, varied logits; the blocks
dequantize to weights of a trained model's spread; the Q4_K_M mix is llama.cpp's; and a sharded
safetensors folder loads in transformers."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pdserve.bench import model_writer
from pdserve.bench.gguf_blocks import WEIGHT_STD, random_tensor
from pdserve.bench.gguf_metadata import read_metadata
from pdserve.bench.model_shapes import SHAPES, tensor_specs
from pdserve.bench.model_writer import QUANTS, tensor_type, write_gguf, write_safetensors
from pdserve.model_source import resolve_model_source

TINY = SHAPES["tiny"]
PROMPT = torch.tensor([[1, 504, 3458, 314, 253, 1838]])


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("write-model")
    return {q: write_gguf(str(folder / f"tiny-{q}.gguf"), TINY, q, seed=3) for q in QUANTS}


@pytest.fixture(scope="module", autouse=True)
def one_parse_per_file():
    """gguf.GGUFReader takes seconds to parse the tokenizer's 100k strings, and transformers parses each
    file twice (its config, then its weights): one reader per file, shared by this module's readbacks and
    transformers' loads, keeps the module's time in bounds without changing what is read."""
    readers: dict[str, gguf.GGUFReader] = {}
    real = gguf.GGUFReader

    def shared(path, mode="r"):
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared)
        yield


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return read_metadata(resolve_model_source(None).gguf_path, "tokenizer.")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits[0]


def _assert_sane(logits: torch.Tensor) -> None:
    assert torch.isfinite(logits).all()
    assert logits.std() > 1e-3  # not all equal
    assert logits.abs().max() < 100  # the weights' spread keeps activations in range


@pytest.mark.parametrize("quant", list(QUANTS))
def test_gguf_reads_back_with_its_types_shapes_and_tokenizer(tiny_files, bundled_tokenizer, quant):
    reader = gguf.GGUFReader(tiny_files[quant])
    specs = tensor_specs(TINY)
    assert [t.name for t in reader.tensors] == [s.gguf_name for s in specs]
    for tensor, spec in zip(reader.tensors, specs):
        assert tensor.tensor_type == tensor_type(spec, TINY, quant), spec.gguf_name
        expected = [spec.cols] if spec.is_vector else [spec.cols, spec.rows]
        assert [int(n) for n in tensor.shape] == expected, spec.gguf_name
    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.block_count"].contents() == TINY.layers
    assert fields["llama.attention.head_count_kv"].contents() == TINY.kv_heads
    assert fields["llama.rope.dimension_count"].contents() == TINY.head_dim
    assert fields["general.file_type"].contents() == QUANTS[quant][1]
    assert len(bundled_tokenizer) > 5
    for key, value, vtype, _ in bundled_tokenizer:
        assert fields[key].types[0] == vtype and fields[key].contents() == value, key


@pytest.fixture(scope="module")
def tiny_config(tiny_files):
    """transformers' config of the tiny shape, as it reads it from a written file's metadata: the same for
    every quant, so each load below passes it rather than parse the metadata again."""
    from transformers import AutoConfig

    path = tiny_files["q4_k_m"]
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert config.model_type == "llama" and config.num_hidden_layers == TINY.layers
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (
        TINY.hidden,
        TINY.ffn,
        TINY.vocab,
    )
    assert (config.num_attention_heads, config.num_key_value_heads) == (TINY.heads, TINY.kv_heads)
    assert not config.tie_word_embeddings
    return config


@pytest.mark.parametrize("quant", list(QUANTS))
def test_transformers_loads_each_gguf_type(tiny_files, tiny_config, quant):
    from transformers import AutoModelForCausalLM

    path = tiny_files[quant]
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), config=tiny_config, dtype=torch.float32
    )
    _assert_sane(_logits(model))


def test_transformers_loads_a_qwen2_gguf_with_its_biases(tmp_path):
    from transformers import AutoModelForCausalLM

    shape = SHAPES["tiny-qwen2"]
    write_gguf(str(tmp_path / "q.gguf"), shape, "q8_0")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf", dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.q_proj.bias.abs().max() > 0
    _assert_sane(_logits(model))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_random_blocks_dequantize_to_a_trained_models_spread(qtype):
    weights = gguf.quants.dequantize(random_tensor(np.random.default_rng(0), qtype, 64, 1024), qtype)
    assert weights.shape == (64, 1024) and np.isfinite(weights).all()
    assert abs(weights.std() / WEIGHT_STD - 1) < 0.1
    assert abs(weights.mean()) < 0.05 * WEIGHT_STD
    # Each 32-weight sub-block is centred: its mean varies as a mean of 32 draws does, no more.
    assert weights.reshape(64, 32, 32).mean(-1).std() < 1.5 * WEIGHT_STD / np.sqrt(32)


def test_q4_k_m_is_llama_quants_mix():
    shape = SHAPES["llama-3.1-8b"]
    types = {s.gguf_name: tensor_type(s, shape, "q4_k_m") for s in tensor_specs(shape)}
    more_bits = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for i in range(shape.layers):
        expected = Q.Q6_K if i in more_bits else Q.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == expected, i
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == Q.Q4_K
        assert types[f"blk.{i}.attn_norm.weight"] == Q.F32
    assert types["token_embd.weight"] == Q.Q4_K and types["output.weight"] == Q.Q6_K
    tied = SHAPES["smollm2-1.7b"]  # the embeddings are the head: Q6_K, as llama-quant makes them
    assert tensor_type(tensor_specs(tied)[0], tied, "q4_k_m") == Q.Q6_K
    small = SHAPES["smollm2-135m"]  # rows of 576: llama-quant's fallbacks
    by_name = {s.gguf_name: s for s in tensor_specs(small)}
    assert tensor_type(by_name["token_embd.weight"], small, "q4_k_m") == Q.Q8_0
    assert tensor_type(by_name["blk.5.attn_q.weight"], small, "q4_k_m") == Q.Q5_0
    assert tensor_type(by_name["blk.4.ffn_down.weight"], small, "q4_k_m") == Q.Q4_K  # 1536 = 6 x 256


def test_sharded_safetensors_folder_loads_in_transformers(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(model_writer, "SHARD_BYTES", 20_000_000)  # three shards of the tiny model
    folder = write_safetensors(str(tmp_path / "tiny"), TINY)
    names = sorted(os.listdir(folder))
    assert "model.safetensors.index.json" in names and "model-00003-of-00003.safetensors" in names
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.model.layers[1].mlp.down_proj.weight.std().item() == pytest.approx(WEIGHT_STD, rel=0.05)
    _assert_sane(_logits(model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(
        tokenizer("The printing press")["input_ids"], skip_special_tokens=True
    ).strip() == ("The printing press")
