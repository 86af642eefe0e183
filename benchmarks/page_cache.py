"""How much of a model's weight files the OS page cache holds, read with mincore(2) (Linux).

A server's start-up time depends on whether its weights come from disk or from memory: a file read
a minute ago (by the other server of a comparison, or an earlier run) is served from the page cache.
The benchmark does not drop that cache (it takes root); it measures and reports the share instead, so a
reader knows which start was timed. mmap without touching the pages reads nothing from disk.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable

import numpy as np

_PROT_READ = 1
_MAP_SHARED = 1
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    c = ctypes
    libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(path: str) -> tuple[int, int] | None:
    """(bytes of `path` in the page cache, its size); None where it cannot be mapped or asked."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        libc = _libc()
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            resident = int(np.count_nonzero(np.ctypeslib.as_array(vec) & 1))
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):  # AttributeError: a libc without mincore (not Linux)
        return None
    finally:
        os.close(fd)
    return min(resident * mmap.PAGESIZE, size), size


def cached_share(paths: Iterable[str]) -> float | None:
    """The share (0..1) of the files' bytes in the page cache; None where any cannot be read or none
    is given."""
    held = total = 0
    for p in paths:
        r = resident_bytes(p)
        if r is None:
            return None
        held, total = held + r[0], total + r[1]
    return held / total if total else None


def weight_files(model: str) -> list[str]:
    """The files a server reads its weights from: a .gguf file itself, or a Hugging Face folder's
    .safetensors files."""
    if os.path.isfile(model):
        return [model]
    if not os.path.isdir(model):
        return []
    names = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
    return [os.path.join(model, f) for f in names if os.path.isfile(os.path.join(model, f))]
