"""The quantized model kept on disk, so that a (re)starting worker maps it instead of quantizing again.

Building a quantized model costs its first start seconds to a minute of CPU (an 8B GGUF: ~30 s on 2
cores), which a restarted worker would spend while the survivors need the cores. The first worker to
build a model stores it in the cache folder (`quantized/<key>.safetensors`, runtime/loader.py, under a
lock) and maps it back; every later start, the launcher's restarts above all, maps it too: tensors only,
no code (safetensors), mapped copy-on-write from the file, so the workers of one host share one copy of
those pages (PSS counts each worker a share of them).

The key names everything the result depends on: the checkpoint's content fingerprint, the mode, the
dtype, batch invariance, this host's kernel plan (instruction set under PDSERVE_CPU_ISA, dense copies,
kernel build) and the source of the quantization code, so that a change to any of them quantizes anew.
Each module is restored by its class with its buffers and plain attributes, then binds its kernel
(`bind_ops`); nothing is computed.

Nothing of the file is trusted before runtime/disk_cache.py has checked it: its record (written beside it,
last) must claim this mode, dtype, batch invariance and checkpoint fingerprint and hold the digest of the
bytes on disk, and the file itself names the same claims. A file changed since it was written, torn, or of
another mode put under this key's name is deleted with a warning and quantized anew, once; a worker never
maps it, so prefill and decode cannot agree on wrong weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from typing import Any

import torch
from torch import nn

from pdserve.kernels import cpu_quant_linear
from pdserve.runtime import disk_cache, quant
from pdserve.runtime.host import cpu_has_amx
from pdserve.runtime.model_config import ModelSpec
from pdserve.runtime.models.llama import CausalLM

log = logging.getLogger(__name__)

FORMAT = 3  # bump when what a file holds changes shape (2: claims inside, record beside; 3: safetensors)
_CLASSES: dict[str, type[nn.Module]] = {
    c.__name__: c for c in (quant.Int8WeightOnlyLinear, quant.Int8DynamicLinear, quant.Int4WeightOnlyLinear)
}
_PLAIN = (bool, int, float, str)


def _source_digest() -> str:
    """The quantization code itself: its Python modules, the kernels' wrapper and their C++."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for rel in (
        "runtime/quant.py",
        "runtime/quant_plan.py",
        "runtime/quant_int8.py",
        "runtime/quant_int4.py",
        "kernels/cpu_quant_linear.py",
        "kernels/cpu_quant_linear.cpp",
    ):
        with open(os.path.join(here, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def cache_key(weights_hash: str, mode: str, dtype: torch.dtype, invariant: bool) -> str:
    plan = quant.dense_plan()
    parts = {
        "format": FORMAT,
        "weights": weights_hash,
        "mode": mode,
        "dtype": str(dtype),
        "invariant": invariant,
        "plan": [plan.keep, plan.min_rows],
        "kernels": [*cpu_quant_linear.support(), cpu_quant_linear.int4_in_bf16()],
        "a8": cpu_quant_linear.int4_a8_support(),
        "amx": cpu_has_amx(),
        "torch": torch.__version__,
        "source": _source_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def claims(weights_hash: str, mode: str, dtype: torch.dtype, invariant: bool) -> dict[str, str | int | bool]:
    """What a file under the key claims to be, in its record and inside it (runtime/disk_cache.py)."""
    return {
        "format": FORMAT,
        "weights": weights_hash,
        "mode": mode,
        "dtype": str(dtype),
        "invariant": invariant,
    }


def cache_path(root: str, key: str) -> str:
    return os.path.join(root, "quantized", f"{key}.safetensors")


def _module_record(m: nn.Module) -> dict[str, Any]:
    plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PLAIN)}
    return {"cls": type(m).__name__, "attrs": plain, "buffers": list(m._buffers)}


def _unique(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """The tensors to write, and the rest as aliases of them: safetensors stores each storage once, so a
    tensor that is another's storage again (w8a16's fp32 scales of an fp32 model) is ["same", name], one
    that is another's transpose (w8a8's qweight_t) ["t", name]."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    seen: dict[tuple[Any, ...], str] = {}

    def key(t: torch.Tensor) -> tuple[Any, ...]:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

    for name, t in state.items():
        if key(t) in seen:
            aliases[name] = ["same", seen[key(t)]]
        elif t.dim() == 2 and key(t.t()) in seen:
            aliases[name] = ["t", seen[key(t.t())]]
        else:
            seen[key(t)] = name
            tensors[name] = t.contiguous()
    return tensors, aliases


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def _write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` as a safetensors file, each written from its own memory: safetensors' `save_file` first
    copies every tensor into a bytes object, 5 GB more at the peak of an 8B model's first start. The
    layout: the header's length (u64), the JSON header (padded to 8 bytes), the tensors' bytes."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for t in tensors.values():
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def store(model: CausalLM, path: str, claimed: disk_cache.Claims) -> None:
    """Write the quantized model to `path` as safetensors (atomically: a reader sees a whole file or
    none), its module records and claims in the header, and its record claiming `claimed` (`claims`)
    beside it. safetensors writes 2 GB in ~1 s here, torch.save in 11-19 s."""
    modules = {name: _module_record(m) for name, m in model.named_modules() if type(m).__name__ in _CLASSES}
    embedding = isinstance(model.model.embed_tokens, quant.PackedInt8Embedding)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    tensors, aliases = _unique(state)
    header = {
        "modules": json.dumps(modules),
        "packed_embedding": json.dumps(embedding),
        "aliases": json.dumps(aliases),
        "claims": json.dumps(dict(claimed), sort_keys=True),
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        _write_safetensors(tmp, tensors, header)
        disk_cache.commit(tmp, path, claimed)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read(path: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The file's header and its tensors, mapped (copy-on-write) from it, aliases resolved."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        header = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
    for name, (how, of) in json.loads(header["aliases"]).items():
        state[name] = state[of] if how == "same" else state[of].t()
    return header, state


def _restore_module(record: dict[str, Any], prefix: str, state: dict[str, torch.Tensor]) -> nn.Module:
    cls = _CLASSES[record["cls"]]
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    for k, v in record["attrs"].items():
        setattr(m, k, v)
    for name in record["buffers"]:
        m.register_buffer(name, state.get(f"{prefix}.{name}"))
    if isinstance(m, quant.Int8DynamicLinear):
        assert m.qweight is not None
        m.qweight_t = m.qweight.t()
    getattr(m, "bind_ops")()  # noqa: B009 (every restored class has it)
    return m


def restore(path: str, spec: ModelSpec, dtype: torch.dtype, claimed: disk_cache.Claims) -> CausalLM | None:
    """The quantized model stored at `path`, its tensors mapped from the file; None where there is no
    usable file (absent, or not what its key and record claim, or unreadable: it is then deleted with a
    warning, quantized anew and stored again)."""
    t0 = time.monotonic()
    if not disk_cache.check(path, claimed):
        return None
    try:
        header, state = _read(path)
        inside = json.loads(header["claims"])
        if inside != json.loads(json.dumps(dict(claimed), sort_keys=True)):
            raise ValueError(f"the file itself claims {inside}")
        model = _rebuild(header, state, spec, dtype)
    except Exception as e:  # noqa: BLE001 - whatever a bad file raises, it is quantized anew
        disk_cache.reject(path, f"the quantized weights could not be read ({type(e).__name__}: {e})")
        return None
    quant.mark_quantized(model)
    log.info("quantized weights mapped from %s in %.2f s (checked)", path, time.monotonic() - t0)
    return model


def _rebuild(
    header: dict[str, str], state: dict[str, torch.Tensor], spec: ModelSpec, dtype: torch.dtype
) -> CausalLM:
    """The model from a file's module records and tensors."""
    modules: dict[str, dict[str, Any]] = json.loads(header["modules"])
    with torch.device("meta"):
        model = CausalLM(spec, rotary=None)  # type: ignore[arg-type]
    if "lm_head.weight" not in state:  # a streamed load keeps only the quantized head (stream_load.py)
        model.lm_head = None
    for name, record in modules.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _restore_module(record, name, state))
    if json.loads(header["packed_embedding"]):
        head = model.lm_head_quant
        assert isinstance(head, quant.Int8WeightOnlyLinear)
        model.model.embed_tokens = quant.PackedInt8Embedding(head, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model
