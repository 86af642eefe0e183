"""The quantized model stored in the cache folder (runtime/quant_cache.py): the first load quantizes and
stores it, the next maps it back and computes bit for bit what the first did; a key per mode, dtype and
batch invariance; an unreadable file is quantized anew, never trusted."""

from __future__ import annotations

import glob
import logging
import os

import pytest
import torch

from pdserve.runtime.loader import load_model
from pdserve.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 8] * k for k in (1, 3)]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


def stored(cache: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache, "quantized", "*.pt")))


def run(loaded, make_engine):
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = make_engine(loaded, attention_backend="auto").generate(PROMPTS, params)
    return [(o.output_ids, o.output_logprobs) for o in outs]


@pytest.mark.parametrize(
    ("name", "mode", "dtype", "deterministic"),
    [
        ("llama3-rope-tied", "w4a16", "float32", "off"),
        ("llama-untied", "w4a8", "float32", "on"),
        ("qwen2-bias", "w8a8_int8", "bfloat16", "off"),
        ("llama3-rope-tied", "w8a16_int8", "bfloat16", "on"),
    ],
)
def test_a_restart_maps_what_the_first_start_quantized(
    cache, tiny_folders, make_engine, caplog, name, mode, dtype, deterministic
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.runtime")
    first = load_model(tiny_folders[name], dtype, "cpu", mode, deterministic)
    assert len(stored(cache)) == 1 and "mapped" not in caplog.text
    again = load_model(tiny_folders[name], dtype, "cpu", mode, deterministic)
    assert "quantized weights mapped from" in caplog.text
    assert again.batch_invariant == first.batch_invariant == (deterministic == "on")
    assert [type(m) for m in again.model.modules()] == [type(m) for m in first.model.modules()]
    # nothing left on the meta device, and every tensor as it was
    a, b = dict(first.model.state_dict()), dict(again.model.state_dict())
    assert a.keys() == b.keys()
    assert all(not t.is_meta and t.dtype == a[k].dtype and torch.equal(t, a[k]) for k, t in b.items())
    assert run(again, make_engine) == run(first, make_engine)


def test_each_mode_and_dtype_has_its_own_file(cache, tiny_folders) -> None:
    folder = tiny_folders["llama-untied"]
    load_model(folder, "float32", "cpu", "w4a16", "off")
    load_model(folder, "bfloat16", "cpu", "w4a16", "off")
    load_model(folder, "float32", "cpu", "w8a16_int8", "off")
    load_model(folder, "float32", "cpu", "w8a16_int8", "on")
    load_model(folder, "float32", "cpu", "none", "off")  # nothing to store
    assert len(stored(cache)) == 4


def test_an_unreadable_file_is_quantized_anew(cache, tiny_folders, make_engine, caplog) -> None:
    folder = tiny_folders["llama-untied"]
    first = load_model(folder, "float32", "cpu", "w4a16", "off")
    (path,) = stored(cache)
    with open(path, "r+b") as f:  # a torn or tampered file
        f.truncate(os.path.getsize(path) // 2)
    again = load_model(folder, "float32", "cpu", "w4a16", "off")
    assert "could not be read" in caplog.text
    assert run(again, make_engine) == run(first, make_engine)
    assert os.path.getsize(path) > 0 and load_model(folder, "float32", "cpu", "w4a16", "off") is not None
