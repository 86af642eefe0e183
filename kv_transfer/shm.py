"""Same-host KV hand-off through shared memory: the prefill node's pool lives in a file under /dev/shm
that the decode node maps read-only, and the decode copies a room's pages out of it into its own pool.

Why the decode copies (pull) rather than the prefill writing (push): every write into the decode's
pool then happens in the decode process, on its pair thread, while the room is TRANSFERRING, exactly as
on the torch.distributed path; an abort or timeout on the decode side can never race with a writer in
another process. What the prefill must guarantee instead is that its pages stay put until the decode
says it has copied them (`Copied`): it frees them on SUCCESS, or, if it gives up first (timeout,
abort, shutdown), it bumps the segment's *fence* before freeing. The decode reads the fence before and
after its copy and compares both with the value announced with the room: any bump fails the room, so
KV copied from pages that may have been reused is never committed.

Segment file `pdserve-kv-<pid>-<random>` (mode 0600, created O_EXCL), HEADER_BYTES of header then the
pool's bytes, page-major as in layout.py:
  [0:8]   magic b"PDSKVSH1"
  [8:40]  a random token, also sent in HelloAck: the decode maps the file only if it reads the same
          bytes back (the same host, the same memory; not a stale file of an earlier process)
  [40:48] the fence, int64, native byte order (only the owner writes it)
  [48:56] the pool's byte size, int64
The decode opens it O_RDONLY|O_NOFOLLOW and refuses a file that is not a regular file of its own user
with mode 0600, of the announced size, inside the segment directory. A file left by a killed process
is removed by the next segment created in the same directory (its pid is gone).

Memory: the file is sparse, as the CPU pool it replaces is (runtime/kv_pool.py), so a segment costs
memory only where KV has been written. A write to a hole of a tmpfs file that has run out of room would
raise SIGBUS, so the segment is created only where the filesystem has room for all of it, and the
prefill node backs pages with memory (`commit`, posix_fallocate) before its allocator first hands them
out: where that fails, the pages are refused like those of a full pool, never written.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
import warnings
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.layout import PoolGeometry

log = logging.getLogger("pdserve.kv_transfer")

HEADER_BYTES = 4096
MAGIC = b"PDSKVSH1"
_TOKEN = slice(8, 40)
_FENCE_AT = 40
_NBYTES_AT = 48
_NAME = re.compile(r"^pdserve-kv-(\d+)-[0-9a-f]{16}$")
DEFAULT_DIR = "/dev/shm"


class ShmError(RuntimeError):
    """The segment cannot be created or mapped; the pair uses torch.distributed instead."""


def _i64(header: torch.Tensor, at: int) -> torch.Tensor:
    return header[at : at + 8].view(torch.int64)


class SharedSegment:
    """The prefill node's side: the segment that holds its KV pool (created, fenced and removed here)."""

    def __init__(self, path: str, mm: mmap.mmap, nbytes: int, token: bytes, fd: int) -> None:
        self.path, self._mm, self.nbytes, self.token = path, mm, nbytes, token
        self._fd: int | None = fd  # kept open for `commit`
        self.committed = 0  # the pool's first bytes (past the header) that are backed by memory
        self._refused = False  # the last `commit` failed (logged once until one succeeds)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer over an mmap: torch warns about nothing real here
            self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self._header = self._bytes[:HEADER_BYTES]

    @classmethod
    def create(cls, nbytes: int, directory: str = DEFAULT_DIR) -> SharedSegment:
        remove_stale(directory)
        token = secrets.token_bytes(32)
        path = os.path.join(directory, f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ShmError(f"cannot create a shared KV segment in {directory}: {exc}") from exc
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            # Sized but sparse (module docstring): memory comes with `commit`. Refused now, cleanly, where
            # the filesystem could not hold all of it, rather than a SIGBUS at a write much later.
            st = os.fstatvfs(fd)
            room = st.f_bavail * st.f_frsize
            if room < HEADER_BYTES + nbytes:
                raise OSError(errno.ENOSPC, f"{HEADER_BYTES + nbytes} bytes needed, {room} free")
            os.ftruncate(fd, HEADER_BYTES + nbytes)
            os.posix_fallocate(fd, 0, HEADER_BYTES)
            mm = mmap.mmap(fd, HEADER_BYTES + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise ShmError(f"cannot size or map the shared KV segment {path}: {exc}") from exc
        seg = cls(path, mm, nbytes, token, fd)
        seg._header[: len(MAGIC)] = torch.frombuffer(bytearray(MAGIC), dtype=torch.uint8)
        seg._header[_TOKEN] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        _i64(seg._header, _FENCE_AT)[0] = 0
        _i64(seg._header, _NBYTES_AT)[0] = nbytes
        return seg

    def pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool tensor in the segment (a view; the segment must outlive it)."""
        return self._bytes[HEADER_BYTES:].view(dtype).view(shape)

    def commit(self, nbytes: int) -> bool:
        """Back the pool's first `nbytes` with memory now (posix_fallocate), so that no write there can
        fault for want of room; False, with a warning, where the filesystem has none left."""
        nbytes = min(nbytes, self.nbytes)
        if nbytes <= self.committed:
            return True
        try:
            if self._fd is None:
                raise OSError(errno.EBADF, "the segment is closed")
            os.posix_fallocate(self._fd, HEADER_BYTES + self.committed, nbytes - self.committed)
        except OSError as exc:
            if not self._refused:
                log.warning(
                    "kv_transfer: no memory for the shared KV pool's first %d bytes (%s); prompts "
                    "wait for pages already in use",
                    nbytes,
                    exc,
                )
            self._refused = True
            return False
        self.committed, self._refused = nbytes, False
        return True

    @property
    def fence(self) -> int:
        return int(_i64(self._header, _FENCE_AT)[0])

    def bump_fence(self) -> None:
        """Before pages a decode node may be copying are freed: its copy will be refused."""
        _i64(self._header, _FENCE_AT)[0] += 1

    def close(self) -> None:
        """Fence, then remove the file (the mapping stays valid for whoever still holds it)."""
        self.bump_fence()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def shared_pool(
    kv: torch.Tensor, directory: str = DEFAULT_DIR, used_pages: int | None = None
) -> tuple[SharedSegment, torch.Tensor]:
    """A segment holding a copy of the CPU pool `kv`, and the pool tensor inside it (use it instead).

    `used_pages`: pages from there on were never written (PageAllocator.high_water), zeros in `kv` as
    in the new segment: they are neither copied nor backed with memory. None: every page is."""
    if kv.is_cuda or not kv.is_contiguous():
        raise ShmError("only a contiguous CPU pool can live in shared memory")
    seg = SharedSegment.create(kv.numel() * kv.element_size(), directory)
    pool = seg.pool(tuple(kv.shape), kv.dtype)
    n = kv.shape[0] if used_pages is None else min(used_pages, kv.shape[0])
    if not seg.commit(n * (kv[0].numel() * kv.element_size())):
        seg.close()
        raise ShmError(f"no room in {directory} for the {n} KV pages in use")
    pool[:n].copy_(kv[:n])
    return seg, pool


def remove_stale(directory: str) -> None:
    """Remove segments of this user whose process is gone (a prefill node that was killed)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = _NAME.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                log.info("kv_transfer: removed the stale shared KV segment %s", path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class MappedPool:
    """The decode node's read-only view of a prefill node's pool (or a TP rank's own pool, writable)."""

    path: str
    pool: torch.Tensor  # [num_pages, L, 2, P, H, D]
    header: torch.Tensor

    @property
    def fence(self) -> int:
        return int(_i64(self.header, _FENCE_AT)[0])

    @classmethod
    def open(
        cls,
        path: str,
        token: bytes,
        num_pages: int,
        geometry: PoolGeometry,
        directory: str = DEFAULT_DIR,
        writable: bool = False,
    ) -> MappedPool:
        """Map a prefill node's segment; ShmError says why not (the pair then uses torch.distributed).
        `writable`: a TP rank maps the segment its rank 0 made for its pool, to use it as the pool."""
        if os.path.dirname(path) != directory.rstrip("/") or not _NAME.match(os.path.basename(path)):
            raise ShmError(f"{path!r} is not a KV segment in {directory}")
        nbytes = num_pages * geometry.page_bytes
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmError(f"cannot open {path} (another host?): {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ShmError(f"{path} is not a private file of this user (mode {st.st_mode & 0o777:o})")
            if st.st_size != HEADER_BYTES + nbytes:
                raise ShmError(f"{path} holds {st.st_size} bytes, {HEADER_BYTES + nbytes} announced")
            # Not populated: a read fault on a hole of the sparse file would give it memory, all of it
            # at once with MAP_POPULATE. A page is mapped at its first copy and stays mapped for the next.
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
        except OSError as exc:
            raise ShmError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # a read-only buffer unless writable: the decode never writes to it
            warnings.simplefilter("ignore")
            data = torch.frombuffer(mm, dtype=torch.uint8)
        header = data[:HEADER_BYTES]
        if bytes(header[: len(MAGIC)].numpy()) != MAGIC or bytes(header[_TOKEN].numpy()) != token:
            raise ShmError(f"{path}: the token read back differs from the one announced")
        if int(_i64(header, _NBYTES_AT)[0]) != nbytes:
            raise ShmError(f"{path}: the header's pool size differs from the one announced")
        pool = data[HEADER_BYTES:].view(geometry.dtype).view(num_pages, *geometry.page_shape)
        return cls(path, pool, header)


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_first, dst_first, n) pieces over which both page lists run consecutively."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def check_pages(pages: list[int], num_pages: int, what: str) -> None:
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise ValueError(f"{what} page ids out of range [0, {num_pages}): {bad[:8]}")


def copy_pages(src: torch.Tensor, src_pages: list[int], dst: torch.Tensor, dst_pages: list[int]) -> int:
    """dst[dst_pages] = src[src_pages], one copy per run of consecutive pages; both lists are
    bounds-checked first (never trusted). Returns the bytes copied."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    check_pages(src_pages, src.shape[0], "source")
    check_pages(dst_pages, dst.shape[0], "destination")
    s_blocks = src.view(src.shape[0], -1)
    d_blocks = dst.view(dst.shape[0], -1)
    for s, d, n in page_runs(src_pages, dst_pages):
        d_blocks[d : d + n].copy_(s_blocks[s : s + n])
    return len(src_pages) * s_blocks.shape[1] * src.element_size()


def copy_heads(
    srcs: list[torch.Tensor],
    src_heads: list[range],
    src_pages: list[int],
    dsts: list[torch.Tensor],
    dst_heads: list[range],
    dst_pages: list[int],
) -> int:
    """Each destination pool's KV heads of `dst_pages` from the first source pool that holds each head,
    of `src_pages`: the pools of two TP layouts ([pages, L, 2, P, its heads, D], `*_heads` the KV heads
    each holds). One copy per (source, destination) overlap and run of consecutive pages; whole pages
    where both hold the same heads (TP 1 to TP 1: copy_pages). Both page lists are bounds-checked against
    every pool first (never trusted). Returns the bytes written."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    for src in srcs:
        check_pages(src_pages, src.shape[0], "source")
    for dst in dsts:
        check_pages(dst_pages, dst.shape[0], "destination")
    runs = page_runs(src_pages, dst_pages)
    nbytes = 0
    for dst, want in zip(dsts, dst_heads):
        at = want.start
        while at < want.stop:
            i = next((i for i, have in enumerate(src_heads) if at in have), None)
            if i is None:
                raise ValueError(f"no source pool holds KV head {at}")
            src, have = srcs[i], src_heads[i]
            stop = min(want.stop, have.stop)
            if have == want:
                nbytes += copy_pages(src, src_pages, dst, dst_pages)
            else:
                s_heads = slice(at - have.start, stop - have.start)
                d_heads = slice(at - want.start, stop - want.start)
                for s, d, n in runs:
                    part = dst[d : d + n, :, :, :, d_heads]
                    part.copy_(src[s : s + n, :, :, :, s_heads])
                    nbytes += part.numel() * part.element_size()
            at = stop
    return nbytes
