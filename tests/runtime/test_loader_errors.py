"""Bad models and bad inputs fail early with errors that say what is wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from pdserve.launch.supervisor import pdserve_command
from pdserve.model_source import ModelSourceError
from pdserve.runtime.loader import load_model
from pdserve.runtime.model_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from pdserve.runtime.runner import ContextLengthError
from pdserve.sampling_params import SamplingParams


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModelError) as err:
        load_model(str(tmp_path))
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg
    assert all(arch in msg for arch in SUPPORTED_ARCHITECTURES)


def test_missing_weight_file_names_the_folder(tiny_folders, tmp_path):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    shutil.copy(os.path.join(tiny_folders["llama-untied"], "config.json"), folder)
    with pytest.raises(ModelSourceError, match="safetensors") as err:
        load_model(str(folder))
    assert str(folder) in str(err.value)


def test_missing_tensor_is_reported(tiny_folders, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_folders["qwen2-bias"]
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    state = load_file(os.path.join(src, "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.self_attn.k_proj.bias'"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("path", ["/nonexistent/model", "relative/missing"])
def test_nonexistent_path(path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_model(path)


def test_empty_folder_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelSourceError, match="neither config.json nor a .gguf"):
        load_model(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        load_model(str(f))


@pytest.fixture
def tiny_engine(tiny_folders, make_engine):
    # max_position_embeddings of the tiny configs is 128.
    return make_engine(load_model(tiny_folders["llama-untied"], dtype="float32"), max_total_tokens=1024)


def test_prompt_beyond_context_window(tiny_engine):
    assert tiny_engine.runner.context_length == 128
    with pytest.raises(ContextLengthError, match="context length 128"):
        tiny_engine.add_request([5] * 129, SamplingParams(max_new_tokens=0))
    with pytest.raises(ContextLengthError):
        tiny_engine.add_request([5] * 100, SamplingParams(max_new_tokens=29))
    tiny_engine.add_request([5] * 100, SamplingParams(max_new_tokens=28))  # exactly fits
    assert tiny_engine.has_work


def test_prompt_beyond_kv_pool(tiny_folders, make_engine):
    engine = make_engine(load_model(tiny_folders["llama-untied"], dtype="float32"), max_total_tokens=32)
    with pytest.raises(ContextLengthError, match="KV pool"):
        engine.add_request([5] * 30, SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize(
    "bad,message",
    [
        ([5, 256], r"token ids must lie in \[0, 256\)"),
        ([-1, 5], r"token ids must lie in \[0, 256\)"),
        ([], "the prompt is empty"),
    ],
)
def test_bad_token_ids(tiny_engine, bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.add_request(bad, SamplingParams(max_new_tokens=4))
    assert not tiny_engine.has_work


@pytest.mark.timeout(120)
def test_cli_generate_with_missing_model_exits_2():
    proc = subprocess.run(
        pdserve_command("generate", "hi", "--model-path", "/nonexistent"),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "/nonexistent" in lines[0] and "does not exist" in lines[0]
    assert proc.stdout == ""
