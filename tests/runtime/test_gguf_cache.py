"""The bundled GGUF model's dequantized folder in the cache (runtime/gguf_folder.py float_folder, which
tensor-parallel ranks and weight updates read): a truncated or changed model.safetensors is deleted with a warning and converted again, never read (a truncated one
used to raise at every start, a worker crash-looping on it; changed bytes were served)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from pdserve.model_source import resolve_model_source
from pdserve.runtime import disk_cache
from pdserve.runtime.loader import model_folder


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """A cache folder holding the bundled model's dequantized folder and its record: a copy of the one in
    the default cache folder (which the other tests of the bundled model use; converted there if absent)."""
    shared = model_folder(resolve_model_source(None))
    root = tmp_path_factory.mktemp("gguf-cache") / "gguf"
    root.mkdir()
    shutil.copytree(shared, root / os.path.basename(shared))
    if os.path.exists(disk_cache.record_path(shared)):  # none where an older pdserve converted it
        shutil.copy(disk_cache.record_path(shared), root)
    return str(root.parent)


@pytest.fixture
def cache(pristine, tmp_path, monkeypatch) -> str:
    """A copy of `pristine` (its folder and record), as this test's cache folder."""
    shutil.copytree(os.path.join(pristine, "gguf"), tmp_path / "gguf")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


def recorded(entry: str) -> dict:
    """The files of `entry` as its record names them (size, digest), each checked against the disk."""
    with open(disk_cache.record_path(entry)) as f:
        files = json.load(f)["files"]
    assert {k: v for k, v in disk_cache.content_digest(entry).items() if k in files} == files
    return files


def same_conversion(folder: str, reference: str) -> bool:
    """`folder` holds what `reference` does. config.json is left out: transformers writes the GGUF's
    path into it (`_name_or_path`), and the reference may come from another install of the package."""
    ours, theirs = recorded(folder), recorded(reference)
    ours.pop("config.json"), theirs.pop("config.json")
    return ours == theirs


def converted(cache: str) -> str:
    folder = model_folder(resolve_model_source(None))
    assert folder.startswith(cache)
    return folder


def test_a_truncated_model_file_is_converted_again(pristine, cache, caplog) -> None:
    folder = converted(cache)
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as f:  # a disk that filled up, or a copy cut short
        f.truncate(os.path.getsize(weights) // 3)
    assert converted(cache) == folder
    assert f"cache entry {folder} is not used" in caplog.text and "truncated" in caplog.text
    assert same_conversion(folder, pristine + folder[len(cache) :])  # converted again, the same bytes
    caplog.clear()
    assert converted(cache) == folder and "not used" not in caplog.text  # checked, and kept


def test_random_bytes_in_the_model_file_are_converted_again(pristine, cache, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.runtime")
    folder = converted(cache)
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) // 2)
        f.write(os.urandom(1 << 20))
    assert converted(cache) == folder
    assert f"cache entry {folder} is not used" in caplog.text and "digest" in caplog.text
    assert "dequantizing" in caplog.text
    assert same_conversion(folder, pristine + folder[len(cache) :])
