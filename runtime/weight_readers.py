"""Where a streaming load (runtime/stream_load.py) reads a checkpoint from, one tensor at a time, by its
Hugging Face name: a GGUF file or a folder of safetensors shards.

Both copy out only the tensor asked for (GGUF: read from the file at its offset; safetensors: from its
own mmap), so reading never holds more than one tensor beside what the model has already kept.

Any weight is also offered as pdserve's packed int4 rows (`packed_int4`): a GGUF tensor whose blocks are
4-bit (Q4_0, Q4_1, Q4_K) is repacked block by block from the file's bytes, its codes, scales and minimums
the file's own, so nothing is rounded twice; any other is rounded to 4 bits in groups of 32 straight from
its blocks or values (kernels/gguf_dequant.py, C++ with torch fallbacks). A float copy is made only where
asked for (`tensor`): dequantized exactly as the `gguf` package (and so transformers' GGUF loader) does.

llama.cpp's converter permutes the rows of `attn_q` and `attn_k` of the "llama" architecture (Mistral's
files use it too) for its rotary layout; the rows are put back here, before dequantizing or repacking
(a row is a whole number of blocks, so permuting the file's raw rows is exact), as transformers does.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open

from pdserve.model_source import ModelSourceError
from pdserve.runtime.gguf_header import TensorEntry, read_header

# GGUF tensor name fragments -> Hugging Face's, for the decoder families pdserve serves
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one pdserve does not load (e.g. rope_freqs)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_NAME.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


class TensorReader(Protocol):
    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, as a new float tensor (GGUF: float32, dequantized; safetensors: its own dtype)."""
        ...

    def packed_int4(self, name: str) -> torch.Tensor | None:
        """The tensor in pdserve's packed int4 layout: a GGUF file's own 4-bit blocks as they are, any other
        weights rounded to 4 bits in groups of 32 (min/max) without a float copy of the whole tensor; None
        where the kernel cannot take it (rows, groups, or scales outside fp16's normal range)."""
        ...

    def source_type(self, name: str) -> str:
        """How the file stores it ("Q4_K", "BF16", ...), for the load's log and its accuracy notes."""
        ...


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order back to Hugging Face's (transformers' `_reverse_permute_weights`)."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


class GGUFTensors:
    """A GGUF file's tensors by Hugging Face name; `heads` (num_attention_heads, num_key_value_heads)
    for the llama architecture's q/k rows."""

    def __init__(self, path: str, heads: tuple[int, int]):
        header = read_header(path)
        self.path = path
        self.architecture = header.architecture
        self._heads = heads
        self._tensors: dict[str, TensorEntry] = {}
        for t in header.tensors.values():
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].dims

    def source_type(self, name: str) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self._tensors[name].ggml_type).name

    def _rows(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, [rows..., bytes of a row] (values or blocks), q/k rows in Hugging
        Face's order, read into a buffer of their own."""
        from pdserve.kernels.gguf_dequant import row_bytes

        t = self._tensors[name]
        *rows, k = t.dims
        data = np.empty((*rows, row_bytes(t.ggml_type, k)), dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(t.offset)
            if f.readinto(data.reshape(-1).data) != data.nbytes:
                raise ValueError(f"the GGUF file ends inside tensor {t.name!r}")
        if self.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self._heads[0] if name.endswith("q_proj.weight") else self._heads[1]
            data = _unpermute_rows(data, heads)
        return data

    def tensor(self, name: str) -> torch.Tensor:
        from pdserve.kernels.gguf_dequant import dequantize

        t = self._tensors[name]
        rows = self._rows(name)
        flat = np.ascontiguousarray(rows.reshape(-1, rows.shape[-1]))
        return dequantize(flat, t.ggml_type, t.dims[-1]).reshape(t.dims)

    def packed_int4(self, name: str) -> torch.Tensor | None:
        from pdserve.kernels.gguf_dequant import DEQUANTIZABLE, int4_scales_fit, to_int4

        t = self._tensors[name]
        if t.ggml_type not in DEQUANTIZABLE or len(t.dims) != 2 or t.dims[0] % 16 or t.dims[1] % 32:
            return None
        packed = to_int4(np.ascontiguousarray(self._rows(name)), t.ggml_type, t.dims[1])
        return packed if int4_scales_fit(packed) else None


class SafetensorsTensors:
    """A Hugging Face folder's safetensors shards; each name read from the shard that holds it."""

    def __init__(self, folder: str):
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise ModelSourceError(f"no *.safetensors weight file in {folder!r}")
        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self._where = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            for name in files:
                path = os.path.join(folder, name)
                with safe_open(path, framework="pt") as handle:
                    self._where.update(dict.fromkeys(handle.keys(), path))

    def _handle(self, name: str) -> Any:
        path = self._where[name]
        if path not in self._files:
            self._files[path] = safe_open(path, framework="pt")
        return self._files[path]

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def source_type(self, name: str) -> str:
        return str(self._handle(name).get_slice(name).get_dtype())

    def tensor(self, name: str) -> torch.Tensor:
        t: torch.Tensor = self._handle(name).get_tensor(name)
        return t

    def packed_int4(self, name: str) -> torch.Tensor | None:
        from pdserve.kernels.gguf_dequant import float_to_int4, int4_scales_fit

        shape = self.shape(name)
        if len(shape) != 2 or shape[0] % 16 or shape[1] % 32:
            return None
        packed = float_to_int4(self.tensor(name))
        return packed if int4_scales_fit(packed) else None
