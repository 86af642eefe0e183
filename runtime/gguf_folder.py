"""What pdserve keeps beside a GGUF file in its cache: the file's digest, and a folder holding the model's
config.json and tokenizer (read from the file's metadata by transformers, once), which the workers'
runtime, grammar backends and fingerprint read as they would a Hugging Face folder's.

The weights themselves are read from the GGUF file at load (runtime/weight_readers.py, stream_load.py)
and kept packed (runtime/quant_cache.py). Only a tensor-parallel rank and a live weight update still
read a float copy (`float_folder`: the whole model dequantized by transformers into safetensors, the
way every GGUF load went before the streaming loader; they read safetensors shards by name).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from pdserve import env
from pdserve.model_source import ModelSource
from pdserve.runtime import disk_cache
from pdserve.runtime.gguf_header import read_header

log = logging.getLogger(__name__)

GGUF_FORMAT = 1  # bump when what a dequantized folder holds changes
META_FORMAT = 1  # bump when what a config-and-tokenizer folder holds changes
# GGUF `general.architecture` -> the Hugging Face class pdserve builds for it
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def gguf_digest(path: str) -> str:
    """xxh3-128 of the file's bytes, remembered per (size, mtime, inode) in the cache folder: hashing an
    8B model's 4.6 GB takes seconds that a restart should not pay again."""
    st = os.stat(path)
    memo = os.path.join(env.cache_dir(), "gguf-digests.json")
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    try:
        with open(memo) as f:
            known: dict[str, str] = json.load(f)
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = disk_cache.file_digest(path)
    known = {k: v for k, v in known.items() if not k.startswith(os.path.realpath(path) + "|")}
    known[key] = digest
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(known, f)
        os.replace(tmp, memo)
    except OSError as e:  # a read-only cache: hash again next time
        log.warning("could not remember the GGUF digest in %s: %s", memo, e)
    return digest


def _cached(kind: str, source: ModelSource, claims: disk_cache.Claims, write: object) -> str:
    """The folder `<cache>/<kind>/<digest>`, written by `write(source, tmp)` once (concurrent starts wait
    on a lock) and checked against its record (runtime/disk_cache.py) at every start: a truncated or
    changed file in it is deleted with a warning and written again, never read."""
    assert source.gguf_path is not None and callable(write)
    dest = os.path.join(env.cache_dir(), kind, str(claims["source"])[:20])
    if disk_cache.check(dest, claims):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if disk_cache.check(dest, claims):  # another worker wrote it meanwhile
            return dest
        t0 = time.monotonic()
        tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".tmp-")
        try:
            write(source, tmp)
            disk_cache.commit(tmp, dest, claims)
            log.info(
                "%s of %s written in %.1f s (cached in %s)",
                kind,
                source.gguf_path,
                time.monotonic() - t0,
                dest,
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _meta_claims(source: ModelSource) -> disk_cache.Claims:
    assert source.gguf_path is not None
    return {"format": META_FORMAT, "source": gguf_digest(source.gguf_path)}


def ready_meta_folder(source: ModelSource) -> str | None:
    """The model's config-and-tokenizer folder where it is already cached and checked, else None (no
    torch needed: the gateway asks this before building it in a child process)."""
    claims = _meta_claims(source)
    dest = os.path.join(env.cache_dir(), "gguf-meta", str(claims["source"])[:20])
    return dest if disk_cache.check(dest, claims) else None


def meta_folder(source: ModelSource) -> str:
    """config.json and the tokenizer of a GGUF model, in a cached folder (no weights)."""
    return _cached("gguf-meta", source, _meta_claims(source), _write_meta)


def _write_meta(source: ModelSource, folder: str) -> None:
    from gguf import GGMLQuantizationType
    from transformers import AutoConfig, AutoTokenizer

    assert source.gguf_path is not None
    header = read_header(source.gguf_path)
    with _metadata_read_once():
        config = AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file).to_dict()
        tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    config.pop("quantization_config", None)
    arch = _ARCHITECTURES.get(config.get("model_type", ""), _ARCHITECTURES.get(header.architecture))
    config["architectures"] = [arch or header.architecture]
    config["tie_word_embeddings"] = "output.weight" not in header.tensors
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.save_pretrained(folder)
    counts: dict[str, int] = {}  # how many of the file's 2-D block weights have each GGML type
    for t in header.tensors.values():
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.dims) == 2:
            name = GGMLQuantizationType(t.ggml_type).name
            counts[name] = counts.get(name, 0) + 1
    with open(os.path.join(folder, "gguf_weight_types.json"), "w") as f:
        json.dump(counts, f)


@contextlib.contextmanager
def _metadata_read_once() -> Iterator[None]:
    """transformers parses the whole GGUF metadata (3 s for the bundled file: the tokenizer's 49,152 tokens
    and merges, one numpy view each) once for the config and again for the tokenizer; here the second
    call gets a copy of the first's answer."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original: Any = getattr(gguf_utils, "load_gguf_checkpoint")  # noqa: B009 (untyped in transformers)
    seen: dict[str, Any] = {}

    def once(path: str, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:
            return original(path, return_tensors, **kwargs)
        if path not in seen:
            seen[path] = original(path, return_tensors=False)
        return copy.deepcopy(seen[path])

    setattr(gguf_utils, "load_gguf_checkpoint", once)  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf_utils, "load_gguf_checkpoint", original)  # noqa: B010


def weight_types(source: ModelSource) -> dict[str, int]:
    """The counts `_write_weight_types` kept in the model's meta folder."""
    with open(os.path.join(meta_folder(source), "gguf_weight_types.json")) as f:
        return dict(json.load(f))


def float_folder(source: ModelSource) -> str:
    """The whole GGUF model dequantized into a cached float32 safetensors folder (tensor-parallel ranks
    and live weight updates read this; a single worker streams the file instead)."""
    assert source.gguf_path is not None
    claims: disk_cache.Claims = {
        "format": GGUF_FORMAT,
        "source": gguf_digest(source.gguf_path),
        "dtype": "float32",
    }
    return _cached("gguf", source, claims, _dequantize_into)


def _dequantize_into(source: ModelSource, folder: str) -> None:
    """The GGUF model as a plain HF folder: float32 safetensors, config.json, the tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info(
        "dequantizing %s into a float copy (tensor parallelism or a weight update reads it)", source.gguf_path
    )
    hf = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(folder, "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tok.save_pretrained(folder)
