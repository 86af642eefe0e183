"""The quantized model stored in the cache folder (runtime/quant_cache.py): the first load quantizes and
stores it, the next maps it back and computes bit for bit what the first did; a key per mode, dtype and
batch invariance; an unreadable, changed or foreign file is deleted with a warning and quantized anew,
never trusted (runtime/disk_cache.py)."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import struct
import time

import pytest
import torch

from pdserve.runtime.loader import load_model
from pdserve.runtime.quant_stage import staged_path
from pdserve.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 8] * k for k in (1, 3)]
BUILT = "loading "  # runtime/stream_load.py's progress line: the checkpoint is read
MAPPED = "quantized weights mapped from"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


def stored(cache: str, at_least: int = 0) -> list[str]:
    """The cache folder's quantized files, once at least `at_least` are there and each one's copy from
    shared memory (runtime/quant_stage.py) is done: its staged file unlinked."""
    deadline = time.monotonic() + 60
    while True:
        files = sorted(glob.glob(os.path.join(cache, "quantized", "*.safetensors")))
        staged = [f for f in files if os.path.exists(staged_path(f))]
        if (len(files) >= at_least and not staged) or time.monotonic() > deadline:
            return files
        time.sleep(0.05)


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
    cache, tiny_folders, make_engine, caplog, monkeypatch, name, mode, dtype, deterministic
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.runtime")
    monkeypatch.setenv("PDSERVE_QUANT_CACHE", "0")
    first = load_model(tiny_folders[name], dtype, "cpu", mode, deterministic)  # built, never stored
    monkeypatch.delenv("PDSERVE_QUANT_CACHE")
    assert not stored(cache)
    built = load_model(tiny_folders[name], dtype, "cpu", mode, deterministic)
    # built from the checkpoint, stored, and mapped back from the file by its builder too
    assert len(stored(cache, 1)) == 1 and BUILT in caplog.text and MAPPED in caplog.text
    assert run(built, make_engine) == run(first, make_engine)
    caplog.clear()
    again = load_model(tiny_folders[name], dtype, "cpu", mode, deterministic)
    assert MAPPED in caplog.text and BUILT not in caplog.text
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
    assert len(stored(cache, 4)) == 4


def test_an_unreadable_file_is_quantized_anew(cache, tiny_folders, make_engine, caplog) -> None:
    folder = tiny_folders["llama-untied"]
    expected = run(load_model(folder, "float32", "cpu", "w4a16", "off"), make_engine)
    (path,) = stored(cache, 1)
    os.rename(path, path + ".old")  # the first model maps the old file: a truncation would fault its pages
    shutil.copy(path + ".old", path)
    with open(path, "r+b") as f:  # a torn or tampered file
        f.truncate(os.path.getsize(path) // 2)
    again = load_model(folder, "float32", "cpu", "w4a16", "off")
    assert f"cache entry {path} is not used" in caplog.text and "truncated" in caplog.text
    assert run(again, make_engine) == expected
    assert stored(cache, 1) == [path] and os.path.getsize(path) > 0  # stored again
    assert load_model(folder, "float32", "cpu", "w4a16", "off") is not None


def biggest_tensor(path: str) -> tuple[int, int]:
    """(offset, size) of the bytes of the file's largest tensor: safetensors stores a u64 header length,
    the JSON header (each tensor's data_offsets from the end of the header), then the tensors' bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    begin, end = max(
        (v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[1] - o[0]
    )
    return 8 + n + begin, end - begin


def test_random_bytes_inside_a_tensor_are_caught_and_quantized_anew(
    cache, tiny_folders, make_engine, caplog
) -> None:
    folder = tiny_folders["llama3-rope-tied"]
    expected = run(load_model(folder, "float32", "cpu", "w4a16", "off"), make_engine)
    (path,) = stored(cache, 1)
    os.rename(path, path + ".old")  # the first model maps the old file, which the writes must not reach
    shutil.copy(path + ".old", path)
    offset, size = biggest_tensor(path)
    with open(path, "r+b") as f:  # bit rot or a stray write: the file still loads, its weights are wrong
        f.seek(offset + size // 4)
        f.write(os.urandom(size // 2))
    caplog.set_level(logging.INFO, logger="pdserve.runtime")
    again = load_model(folder, "float32", "cpu", "w4a16", "off")
    assert run(again, make_engine) == expected
    assert f"cache entry {path} is not used" in caplog.text and "digest" in caplog.text
    assert BUILT in caplog.text  # quantized anew
    caplog.clear()  # the file was stored again: the next start maps it, with no warning
    third = load_model(folder, "float32", "cpu", "w4a16", "off")
    assert MAPPED in caplog.text and "not used" not in caplog.text and BUILT not in caplog.text
    assert run(third, make_engine) == expected


@pytest.mark.parametrize("how", ["with its record", "alone", "with a record rewritten to claim w4a16"])
def test_a_file_of_another_mode_under_the_key_is_refused(
    cache, tiny_folders, make_engine, caplog, how
) -> None:
    from pdserve.runtime import disk_cache, quant, quant_cache

    folder = tiny_folders["llama-untied"]
    load_model(folder, "float32", "cpu", "w8a16_int8", "off")
    (int8,) = stored(cache, 1)
    first = load_model(folder, "float32", "cpu", "w4a16", "off")
    expected = run(first, make_engine)
    (int4,) = set(stored(cache, 2)) - {int8}
    os.rename(int4, int4 + ".old")  # `first` maps it: replaced by a new file, not written through
    if how == "with its record" and os.path.exists(disk_cache.record_path(int8)):
        shutil.copy(disk_cache.record_path(int8), disk_cache.record_path(int4))
    if how == "with a record rewritten to claim w4a16":
        claims = quant_cache.claims(first.weights_hash, "w4a16", torch.float32, False)
        shutil.copy(int8, int4 + ".new")
        disk_cache.commit(int4 + ".new", int4, claims)
    else:
        shutil.copy(int8, int4)
    again = load_model(folder, "float32", "cpu", "w4a16", "off")
    assert again.quantization == "w4a16"
    assert not any(isinstance(m, quant.Int8WeightOnlyLinear) for m in again.model.model.layers.modules())
    assert {type(m) for m in again.model.modules()} >= {quant.Int4WeightOnlyLinear}
    assert f"cache entry {int4} is not used" in caplog.text
    assert run(again, make_engine) == expected
