"""Weight loading: Hugging Face folders (safetensors), GGUF files, and the bundled default model.

A single worker streams its checkpoint tensor by tensor into the model's final form
(runtime/stream_load.py): a GGUF file's 4-bit blocks are repacked into pdserve's int4 layout without a
float copy, and no load holds a whole-model float copy. A quantized model is then stored packed in the
cache (runtime/quant_cache.py) and every worker of the host maps that one file, its first builder too.
A GGUF file's config and tokenizer are read from its metadata once (runtime/gguf_folder.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import glob
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pdserve import env
from pdserve.model_source import ModelSource, ModelSourceError, resolve_model_source
from pdserve.progress import progress
from pdserve.runtime import cpu_calibration, gguf_folder, quant_cache, quant_stage
from pdserve.runtime.determinism import DeterminismError, resolve_batch_invariance
from pdserve.runtime.disk_cache import Claims
from pdserve.runtime.model_config import ModelSpec, rope_inv_freq
from pdserve.runtime.models.llama import CausalLM
from pdserve.runtime.models.norm_rope import Rotary
from pdserve.runtime.quant import (
    a8_multiplies_faster,
    all_invariant,
    check_quantization,
    dense_plan,
    quantize_model,
)
from pdserve.runtime.quant_plan import DENSE_COPY_MAX_BYTES, dense_copies_fit
from pdserve.runtime.stream_load import BuildPlan, build_model, projection_params
from pdserve.runtime.tp_layout import TPLayout, read_shard, shard_modules, shard_of
from pdserve.runtime.weight_readers import GGUFTensors, SafetensorsTensors, TensorReader

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on CPU whichever this host's matmuls run faster, as measured once per
    host (runtime/cpu_calibration.py: bf16 where it is at least 1.3x faster, else float32)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        speeds = cpu_calibration.matmul_speeds()
        log.info("dtype auto: %s", speeds.why())
        return torch.bfloat16 if speeds.bf16_wins else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def release_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): the float weights a
    quantized model replaced are freed, but glibc keeps most of that memory in its heap, so a worker
    held ~240 MB more than its tensors (the bundled model, measured). A no-op without glibc."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    folder: str  # plain HF folder the weights and tokenizer were read from
    weights_hash: str
    tokenizer_hashes: dict[str, str]  # tokenizer_hashes(folder), hashed once at load
    dtype: torch.dtype
    device: torch.device
    quantization: str = "none"  # runtime/quant.py's mode of the Linear weights
    batch_invariant: bool = False  # runtime/determinism.py
    batch_invariant_why: str = "--deterministic off"
    tp_layout: TPLayout | None = None  # a tensor-parallel rank's model: how it splits (runtime/tp_layout.py)
    tp_rank: int = 0


def cache_root() -> str:
    return env.cache_dir()


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)


def tokenizer_hashes(folder: str) -> dict[str, str]:
    """{"tokenizer": hash of the tokenizer's files, "chat_template": hash of the chat template} of a model
    folder ("none" where there is none), for the compatibility record (pdserve/protocol/compat.py)."""
    tok = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            tok.update(name.encode() + b"\0" + _file_sha256(path).encode())
    template = ""
    config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            template = json.dumps(json.load(f).get("chat_template") or "", sort_keys=True)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template += f.read()
    return {
        "tokenizer": tok.hexdigest()[:16] if tok.digest() != hashlib.sha256().digest() else "none",
        "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16] if template else "none",
    }


def model_folder(source: ModelSource) -> str:
    """A plain HF folder (config.json, *.safetensors, tokenizer) for any supported source: a GGUF model's
    float copy (runtime/gguf_folder.py), for the readers of safetensors shards (TP ranks, weight updates)."""
    return gguf_folder.float_folder(source) if source.gguf_file else source.folder


def _weight_files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelSourceError(f"no *.safetensors weight file in {folder!r}")
    return files


def weights_hash(folder: str) -> str:
    """A cheap content fingerprint: every file's size plus 16 sampled 64 KiB windows."""
    h = hashlib.sha256()
    for path in _weight_files(folder):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(1 << 16))
    return h.hexdigest()[:16]


def iter_weights(
    folder: str, shard: tuple[TPLayout, int, int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by HF name; with `shard` (layout, rank, head_dim), only that tensor-parallel
    rank's rows and columns of each (runtime/tp_layout.py)."""
    for path in _weight_files(folder):
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            desc = f"loading {os.path.basename(path)}"
            for name in progress(names, len(names), desc, log.info, unit="tensors"):
                if shard is None:
                    yield name, f.get_tensor(name)
                else:
                    layout, rank, head_dim = shard
                    yield name, read_shard(f, name, shard_of(name, layout, rank, head_dim))


def load_hf_config(folder: str) -> PretrainedConfig:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelSourceError(f"no config.json in {folder!r}")
    config: PretrainedConfig = AutoConfig.from_pretrained(folder)
    return config


def resolve_quantization(
    quantization: str, dtype: str, device: torch.device, source: ModelSource
) -> tuple[str, str]:
    """(mode, why) for `--quantization auto`: on CPU a GGUF model is served in its own quantization,
    as llama.cpp serves it (its weights are already quantized); an HF checkpoint, CUDA and an
    explicit --dtype float32 (the exactness reference) get none. Any other value is the user's."""
    if quantization != "auto":
        return quantization, "asked"
    if dtype == "float32":
        return "none", "--dtype float32"
    if dtype == "float16":
        return "none", "the quantized kernels take bfloat16 or float32 activations"
    if device.type != "cpu" or source.gguf_file is None:
        return "none", "not a GGUF model on CPU"
    types = gguf_folder.weight_types(source)
    if not types:
        return "none", "the GGUF file has no quantized block weights"
    main = max(types, key=lambda k: types[k])
    if main in ("F32", "F16", "BF16"):
        return "none", f"the GGUF's weights are {main}"
    if main not in ("Q4_0", "Q4_1", "Q4_K"):
        return "w8a16_int8", f"the GGUF's {main} weights"
    if resolve_dtype(dtype, device) == torch.float32 and a8_multiplies_faster():
        # Where int4 multiplies in fp32, int8 activations (integer dot products) are 2-3x faster at every
        # batch size, and what llama.cpp computes for this file here.
        return "w4a8", f"the GGUF's {main} weights; int8 activations, as llama.cpp's CPU kernels on this host"
    return "w4a16", f"the GGUF's {main} weights"


def _load_and_quantize(
    folder: str,
    spec: ModelSpec,
    dev: torch.device,
    dtype: torch.dtype,
    mode: str,
    invariant: bool,
    shard: tuple[TPLayout, int] | None = None,
) -> CausalLM:
    """The checkpoint's weights in `dtype` on `dev`, quantized under `mode` (runtime/quant.py); with
    `shard` (layout, rank), that rank's part of them, cut before the cast and the quantization."""
    with torch.device("meta"):
        model = CausalLM(spec, rotary=None)  # type: ignore[arg-type]
    if shard is not None:
        shard_modules(model, shard[0], shard[1])
    model = model.to_empty(device="cpu")
    model.load_weights(iter_weights(folder, None if shard is None else (*shard, spec.head_dim)))
    model = model.to(device=dev, dtype=dtype)
    t0 = time.monotonic()
    n = quantize_model(model, mode, dtype, invariant)
    if n:
        log.info("quantized %d projections and the LM head: %s, in %.1f s", n, mode, time.monotonic() - t0)
        release_freed_heap()  # the float weights quantization replaced
    return model


def _read_or_build(
    source: ModelSource,
    folder: str,
    spec: ModelSpec,
    plan: BuildPlan,
    layout: TPLayout | None,
    tp_rank: int,
) -> CausalLM:
    """The model with its weights: a single worker streams its checkpoint (runtime/stream_load.py); a
    tensor-parallel rank reads its cut of the float safetensors (`_load_and_quantize`)."""
    if layout is not None:
        shard = (layout, tp_rank)
        return _load_and_quantize(folder, spec, plan.device, plan.dtype, plan.mode, plan.invariant, shard)
    if source.gguf_path is not None:
        reader: TensorReader = GGUFTensors(source.gguf_path, (spec.num_heads, spec.num_kv_heads))
        what = os.path.basename(source.gguf_path)
    else:
        reader, what = SafetensorsTensors(folder), os.path.basename(folder.rstrip("/"))
    model = build_model(spec, reader, plan, what)
    release_freed_heap()  # the float parts the projections were built from
    return model


def _cached_model(
    source: ModelSource, folder: str, spec: ModelSpec, plan: BuildPlan, files_hash: str
) -> CausalLM:
    """The quantized model mapped from the cache (runtime/quant_cache.py), built and stored there first
    where it is not yet: under a lock, so that workers starting together build it once, into shared
    memory where it fits (runtime/quant_stage.py: copied to the cache folder by a process), and mapped
    back from the file by its builder too, so that every worker of the host shares one copy of its pages."""
    claims = quant_cache.claims(files_hash, plan.mode, plan.dtype, plan.invariant)
    key = quant_cache.cache_key(files_hash, plan.mode, plan.dtype, plan.invariant)
    stored = quant_cache.cache_path(cache_root(), key)
    model = _mapped(stored, spec, plan, claims)
    if model is not None:
        return model
    os.makedirs(os.path.dirname(stored), exist_ok=True)
    with open(stored + ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        model = _mapped(stored, spec, plan, claims)  # another worker built it meanwhile
        if model is not None:
            return model
        built = _read_or_build(source, folder, spec, plan, None, 0)
        size = sum(t.untyped_storage().nbytes() for t in built.state_dict().values())
        target = quant_stage.staging_path(stored, size) or stored
        try:
            quant_cache.store(built, target, claims)
        except OSError as e:  # a read-only or full cache folder: the next start quantizes again
            log.warning("could not store the quantized weights in %s: %s", target, e)
            return built
        if target != stored:
            quant_stage.persist_later(target, stored, claims)
    mapped = quant_cache.restore(target, spec, plan.dtype, claims)
    if mapped is None:
        return built
    del built
    release_freed_heap()
    return mapped


def _mapped(stored: str, spec: ModelSpec, plan: BuildPlan, claims: Claims) -> CausalLM | None:
    """The model mapped from the cache folder, or from shared memory where a builder staged it (a copy to
    the cache folder started again where the builder did not live to finish it)."""
    model = quant_cache.restore(stored, spec, plan.dtype, claims)
    if model is not None:
        return model
    staged = quant_stage.staged_path(stored)
    if not os.path.exists(staged):
        return None
    model = quant_cache.restore(staged, spec, plan.dtype, claims)
    if model is not None and not os.path.exists(stored):
        quant_stage.persist_later(staged, stored, claims)
    return model


def load_model(
    model_path: str | None,
    dtype: str = "auto",
    device: str = "cpu",
    quantization: str = "auto",
    deterministic: str = "auto",
    attention_backend: str = "auto",
    tp_size: int = 1,
    tp_rank: int = 0,
) -> LoadedModel:
    """The model, its weights loaded (and quantized); `deterministic` and `attention_backend` as the
    runtime's flags (batch invariance shapes the quantized modules); with `tp_size` > 1, rank
    `tp_rank`'s part of it (runtime/tp_layout.py)."""
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if quantization != "auto":
        check_quantization(quantization, dev, torch_dtype)  # before the slow part: a bad flag fails fast
    source = resolve_model_source(model_path)
    folder = source.folder
    if source.gguf_path is not None:
        folder = gguf_folder.meta_folder(source) if tp_size == 1 else gguf_folder.float_folder(source)
    quantization, why = resolve_quantization(quantization, dtype, dev, source)
    if why != "asked":
        log.info("quantization auto: %s (%s)", quantization, why)
        check_quantization(quantization, dev, torch_dtype)
    invariant, invariant_why = resolve_batch_invariance(deterministic, quantization, dev, attention_backend)
    config = load_hf_config(folder)
    spec = ModelSpec.from_hf_config(config)
    layout = TPLayout.of(spec, tp_size) if tp_size > 1 else None
    if source.gguf_path is not None:
        files_hash = gguf_folder.gguf_digest(source.gguf_path)[:16]
    else:  # fails early, with the folder named, if weights are missing
        files_hash = weights_hash(folder)
    inv_freq, scaling = rope_inv_freq(config, spec.head_dim)
    fits = dense_copies_fit(projection_params(spec), torch_dtype)
    if not fits and dense_plan().keep:
        log.info(
            "no dense copies of the quantized weights: this model's would take more than %.1f GB",
            DENSE_COPY_MAX_BYTES / 1e9,
        )
    plan = BuildPlan(dev, torch_dtype, quantization, invariant, fits)
    # CPU only (check_quantization); a TP rank's shard is not cached
    if quantization != "none" and env.quant_cache_enabled() and layout is None:
        model = _cached_model(source, folder, spec, plan, files_hash)
    else:
        model = _read_or_build(source, folder, spec, plan, layout, tp_rank)
    # Attached after the dtype cast: the cos/sin table stays fp32 and is cast per use.
    model.rotary = Rotary(inv_freq, scaling, spec.context_length).to(dev)
    if invariant and not all_invariant(model):
        why = "a projection of this model cannot take pdserve's kernel (its shape or its scales)"
        if deterministic == "on":
            raise DeterminismError(f"--deterministic on: {why}")
        invariant, invariant_why = False, f"auto: off, {why}"
    model.eval()
    return LoadedModel(
        model,
        spec,
        folder,
        files_hash,
        tokenizer_hashes(folder),
        torch_dtype,
        dev,
        quantization,
        invariant,
        invariant_why,
        layout,
        tp_rank,
    )
