"""Weight loading: Hugging Face folders (safetensors), GGUF files, and the bundled default model.

A GGUF file is dequantized once through transformers' GGUF reader (~17 s for the default model)
and cached as a plain safetensors folder keyed by the file's hash, so later starts take seconds.
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
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pdserve import env
from pdserve.model_source import ModelSource, ModelSourceError, resolve_model_source
from pdserve.progress import progress
from pdserve.runtime import cpu_calibration, disk_cache, quant_cache
from pdserve.runtime.determinism import DeterminismError, resolve_batch_invariance
from pdserve.runtime.model_config import ModelSpec, rope_inv_freq
from pdserve.runtime.models.llama import CausalLM
from pdserve.runtime.models.norm_rope import Rotary
from pdserve.runtime.quant import a8_multiplies_faster, all_invariant, check_quantization, quantize_model
from pdserve.runtime.tp_layout import TPLayout, read_shard, shard_modules, shard_of

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


GGUF_FORMAT = 1  # bump when what a dequantized folder holds changes


def gguf_to_folder(source: ModelSource) -> str:
    """Dequantize a GGUF file into a cached safetensors folder (once; concurrent starts wait on a lock).
    The folder is checked against its record (runtime/disk_cache.py) at every start: a truncated or
    changed file in it is deleted with a warning and dequantized again, never read."""
    assert source.gguf_path is not None
    digest = _file_sha256(source.gguf_path)
    dest = os.path.join(cache_root(), "gguf", digest[:20])
    claims: disk_cache.Claims = {"format": GGUF_FORMAT, "source": digest, "dtype": "float32"}
    if disk_cache.check(dest, claims):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if disk_cache.check(dest, claims):  # another worker dequantized it meanwhile
            return dest
        log.info("dequantizing %s (once; cached in %s)", source.gguf_path, dest)
        t0 = time.monotonic()
        tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".tmp-")
        try:
            _dequantize_into(source, tmp)
            disk_cache.commit(tmp, dest, claims)
            log.info("dequantized %s in %.1f s", source.gguf_path, time.monotonic() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _dequantize_into(source: ModelSource, folder: str) -> None:
    """The GGUF model as a plain HF folder: float32 safetensors, config.json, the tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


def model_folder(source: ModelSource) -> str:
    """A plain HF folder (config.json, *.safetensors, tokenizer) for any supported source."""
    return gguf_to_folder(source) if source.gguf_file else source.folder


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


def gguf_weight_types(source: ModelSource, folder: str) -> dict[str, int]:
    """How many of a GGUF file's 2-D block weights have each GGML type, e.g. {"Q4_1": 210}; read once
    (parsing the file's header takes seconds) and kept beside the dequantized folder."""
    assert source.gguf_path is not None
    cached = os.path.join(folder, "gguf_weight_types.json")
    try:
        with open(cached) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        pass
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(source.gguf_path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    tmp = f"{cached}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(counts, f)
    os.replace(tmp, cached)
    return counts


def resolve_quantization(
    quantization: str, dtype: str, device: torch.device, source: ModelSource, folder: str
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
    types = gguf_weight_types(source, folder)
    if not types:
        return "none", "the GGUF file has no quantized block weights"
    main = max(types, key=lambda k: types[k])
    if main in ("F32", "F16", "BF16"):
        return "none", f"the GGUF's weights are {main}"
    if main not in ("Q4_0", "Q4_1"):
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
    folder = model_folder(source)
    quantization, why = resolve_quantization(quantization, dtype, dev, source, folder)
    if why != "asked":
        log.info("quantization auto: %s (%s)", quantization, why)
        check_quantization(quantization, dev, torch_dtype)
    invariant, invariant_why = resolve_batch_invariance(deterministic, quantization, dev, attention_backend)
    config = load_hf_config(folder)
    spec = ModelSpec.from_hf_config(config)
    layout = TPLayout.of(spec, tp_size) if tp_size > 1 else None
    files_hash = weights_hash(folder)  # fails early, with the folder named, if weights are missing
    inv_freq, scaling = rope_inv_freq(config, spec.head_dim)
    stored = None
    claims = quant_cache.claims(files_hash, quantization, torch_dtype, invariant)
    # CPU only (check_quantization); a TP rank's shard is not cached
    if quantization != "none" and env.quant_cache_enabled() and layout is None:
        stored = quant_cache.cache_path(
            cache_root(), quant_cache.cache_key(files_hash, quantization, torch_dtype, invariant)
        )
    model = quant_cache.restore(stored, spec, torch_dtype, claims) if stored else None
    if model is None:
        shard = None if layout is None else (layout, tp_rank)
        model = _load_and_quantize(folder, spec, dev, torch_dtype, quantization, invariant, shard)
        if stored:
            try:
                quant_cache.store(model, stored, claims)
            except OSError as e:  # a read-only or full cache folder: the next start quantizes again
                log.warning("could not store the quantized weights in %s: %s", stored, e)
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
