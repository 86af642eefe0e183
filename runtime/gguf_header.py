"""The part of a GGUF file's header a load needs: its architecture and where each tensor's bytes lie.

The `gguf` package's reader parses every metadata value into numpy arrays, the tokenizer's 49,152 tokens
each into arrays of their own: 1.6 s and ~100 MB of Python objects for the bundled model, held for as
long as the reader lives. A load needs none of that (the config and tokenizer are read once, into the
cache, by runtime/gguf_folder.py), so this reads the header's values it needs and skips the rest.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64;
each metadata entry a key (u64 length + bytes), a value type u32 and the value; then each tensor's name,
dimension count u32, dimensions u64 each (fastest first), GGML type u32 and offset u64 from the start
of the data, which begins at the header's end rounded up to `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

from pdserve.model_source import ModelSourceError

# value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # as Hugging Face orders them: rows first, the fastest dimension last
    offset: int  # of its first byte in the file


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str
    tensors: dict[str, TensorEntry]


def _read(f: BinaryIO, fmt: str) -> int | float | bool:
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise ModelSourceError("the GGUF file ends inside its header")
    value: int | float | bool = struct.unpack("<" + fmt, data)[0]
    return value


def _string(f: BinaryIO) -> str:
    n = int(_read(f, "Q"))
    if n > 1 << 24:
        raise ModelSourceError(f"the GGUF header names a string of {n} bytes")
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int) -> object:
    """A scalar or string value; an array is skipped (None): no value a load needs is one."""
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype != _ARRAY:
        raise ModelSourceError(f"the GGUF header has a value of unknown type {vtype}")
    etype, count = int(_read(f, "I")), int(_read(f, "Q"))
    if etype in _SCALARS:
        f.seek(count * struct.calcsize("<" + _SCALARS[etype]), 1)
    elif etype == _STRING:
        for _ in range(count):
            f.seek(int(_read(f, "Q")), 1)
    else:
        for _ in range(count):
            _value(f, etype)
    return None


def read_header(path: str) -> GGUFHeader:
    """The architecture and tensor table of the GGUF file at `path`."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelSourceError(f"{path!r} is not a GGUF file (no GGUF magic)")
        version = int(_read(f, "I"))
        if version not in (2, 3):
            raise ModelSourceError(f"{path!r} is GGUF version {version}; pdserve reads versions 2 and 3")
        n_tensors, n_values = int(_read(f, "Q")), int(_read(f, "Q"))
        meta: dict[str, object] = {}
        for _ in range(n_values):
            key = _string(f)
            meta[key] = _value(f, int(_read(f, "I")))
        infos = []
        for _ in range(n_tensors):
            name = _string(f)
            dims = tuple(int(_read(f, "Q")) for _ in range(int(_read(f, "I"))))
            infos.append((name, int(_read(f, "I")), tuple(reversed(dims)), int(_read(f, "Q"))))
        align = int(meta.get("general.alignment") or 32)  # type: ignore[call-overload]
        start = -(-f.tell() // align) * align
    tensors = {n: TensorEntry(n, t, d, start + o) for n, t, d, o in infos}
    return GGUFHeader(str(meta.get("general.architecture", "")), tensors)
