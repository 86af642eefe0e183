"""Read a GGUF file's metadata keys, fast: for copying the bundled model's tokenizer into written files.

gguf.GGUFReader parses every field through numpy memmap slices, which takes seconds for a tokenizer's
100k strings; every file `pdserve bench write-model` writes copies those keys, so it reads them here
with struct, in tens of milliseconds. Only the key-value section is read (GGUF v2/v3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGUFValueType

T = GGUFValueType
_SCALAR = {
    T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
    T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d",
}  # fmt: skip
_NUMPY = {T.UINT8: "<u1", T.INT8: "<i1", T.UINT16: "<u2", T.INT16: "<i2", T.UINT32: "<u4", T.INT32: "<i4",
          T.FLOAT32: "<f4", T.BOOL: "?", T.UINT64: "<u8", T.INT64: "<i8", T.FLOAT64: "<f8"}  # fmt: skip


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return self.data[self.pos - n : self.pos].decode("utf-8")

    def value(self, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
        """A value and, for an array, its elements' type."""
        if vtype == T.STRING:
            return self.string(), None
        if vtype != T.ARRAY:
            return self.unpack(_SCALAR[vtype]), None
        sub, n = T(self.unpack("<I")), self.unpack("<Q")
        if sub in _NUMPY:
            items = np.frombuffer(self.data, _NUMPY[sub], n, self.pos)
            self.pos += items.nbytes
            return items.tolist(), sub
        return [self.value(sub)[0] for _ in range(n)], sub


def read_metadata(path: str, prefix: str = "") -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """The metadata keys of `path` that start with `prefix`, in file order: (key, value, type, the
    element type of an array or None), as GGUFWriter.add_key_value takes them."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _read(data, path, prefix)


def _read(
    data: mmap.mmap, path: str, prefix: str
) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    magic, version, _tensors, n_kv = struct.unpack_from("<IIQQ", data, 0)
    if magic != GGUF_MAGIC or version < 2:
        raise ValueError(f"{path} is no little-endian GGUF v2+ file")
    cursor = _Cursor(data)
    cursor.pos = 24
    found = []
    for _ in range(n_kv):
        key = cursor.string()
        vtype = T(cursor.unpack("<I"))
        value, sub = cursor.value(vtype)
        if key.startswith(prefix):
            found.append((key, value, vtype, sub))
    return found
