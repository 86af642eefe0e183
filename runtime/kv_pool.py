"""The paged KV cache: one tensor for all layers, and a page allocator with reference counts.

Layout `[num_pages, num_layers, 2, page_size, kv_heads, head_dim]` (index 2: 0 = K, 1 = V): page-major,
so one page (all layers' K and V of page_size tokens) is one contiguous block. KV transfer moves a
request's pages as whole blocks (memcpy-sized copies, or none where page runs are contiguous), and
each layer's K (or V) is a strided `[num_pages, page_size, kv_heads, head_dim]` view.

For torch indexing, `rows()` views the pool as rows of [kv_heads, head_dim]; token slot
`page * page_size + offset` of layer l's K is row `slot_rows(slot) + row_offset(l, 0)`.

Memory on CPU follows the load, not the pool's size: the pool is a fresh anonymous mapping that
nothing writes at start, so Linux backs a page of it with memory only when a forward first writes
KV there, and a page never written reads as zeros. The allocator hands out the lowest-numbered free
pages first, so the pages in use stay packed at the front of the pool and its resident memory is
that of the most pages ever held at once (requests' and the prefix cache's), whatever the size.

On CPU the pool also asks Linux for transparent huge pages (`madvise(MADV_HUGEPAGE)`, before its
first touch): decode attention reads requests' pages scattered over hundreds of MB, and huge pages
cut its time at batch 64 by ~18% (docs/cpu.md, "Measured"; fewer TLB misses is the likely cause, not
measured). They are granted at the first write of each 2 MiB, so memory then grows in 2 MiB steps.
Where the kernel or its settings refuse, the pool keeps ordinary pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import heapq
import math
import mmap
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

_MADV_HUGEPAGE = 14  # linux/mman.h


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor's memory with transparent huge pages; False where it cannot."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = t.data_ptr() & ~4095  # madvise wants a page-aligned start
    length = t.data_ptr() + t.numel() * t.element_size() - start
    rc: int = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return rc == 0


def untouched_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in a fresh private anonymous mapping of its own, none of it resident yet.

    Linux backs each page of the mapping with memory at its first write; until then it reads as
    zeros (the shared zero page), so the tensor costs memory only where it is written. torch.empty
    gives no such promise (a small one may reuse freed, dirty heap memory), nor does torch.zeros
    (it writes every byte). The mapping is unmapped when the last tensor viewing it is freed.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=dtype).view(shape)  # the tensor holds the mapping alive


class KVPool:
    def __init__(self, geometry: KVGeometry, num_pages: int, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.geometry = geometry
        self.num_pages = num_pages
        g = geometry
        # [num_pages, num_layers, 2, page_size, kv_heads, head_dim]
        shape = (num_pages, g.num_layers, 2, g.page_size, g.kv_heads, g.head_dim)
        if torch.device(device).type == "cpu":
            # Zeros that cost nothing until written (module docstring): no first touch here.
            self.kv = untouched_cpu_tensor(shape, g.dtype)
            self.huge_pages = advise_huge_pages(self.kv)
        else:
            self.kv = torch.zeros(shape, dtype=g.dtype, device=device)
            self.huge_pages = False

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[:, layer, 0]  # [num_pages, page_size, kv_heads, head_dim], strided over pages

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[:, layer, 1]

    def rows(self) -> torch.Tensor:
        """The pool as [num_pages * num_layers * 2 * page_size, kv_heads, head_dim] rows (a view)."""
        g = self.geometry
        return self.kv.view(-1, g.kv_heads, g.head_dim)

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Row in `rows()` of layer 0's K for each token slot (page * page_size + offset)."""
        g = self.geometry
        return (slots // g.page_size) * (g.num_layers * 2 * g.page_size) + slots % g.page_size

    def key_rows(self, page_table: torch.Tensor, length: int) -> torch.Tensor:
        """[B * length] row in `rows()` (layer 0's K) of positions 0..length-1 of each request whose
        pages are the rows of `page_table` [B, max_pages]; positions past a request's pages fall in
        its padding page ids."""
        ps = self.geometry.page_size
        j = torch.arange(length, device=page_table.device)
        return self.slot_rows(page_table[:, j // ps].long() * ps + j % ps).view(-1)

    def row_offset(self, layer: int, kind: int) -> int:
        """Add to `slot_rows` for layer `layer`'s K (kind 0) or V (kind 1)."""
        return (2 * layer + kind) * self.geometry.page_size

    @staticmethod
    def pages_for(geometry: KVGeometry, max_total_tokens: int) -> int:
        return -(-max_total_tokens // geometry.page_size)


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Plain-Python page bookkeeping. A page is free iff its reference count is 0.

    Reference counts let several requests share prefix pages; `free` drops one reference.

    `alloc` hands out the lowest-numbered free pages (a min-heap), in ascending order: the pages in use
    stay packed at the front of the pool, so the pool's memory, committed page by page at the first
    write (KVPool), is that of the most pages ever held at once, not of the pool's size. Freed pages
    are reused before any never used (they lie below it), and a run of consecutive pages freed
    together comes back as the same run, which KV transfer moves without staging copies.

    `high_water` counts the pages ever handed out: pages `high_water` and up have never been written.
    `on_grow`, when set, is called with the new mark before an `alloc` first hands out pages past it;
    it returns False where that memory cannot be had, and `alloc` then raises OutOfPages, taking nothing.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages))  # a min-heap (a sorted list is one)
        self.high_water = 0
        self.on_grow: Callable[[int], bool] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]  # ascending
        top = pages[-1] + 1 if pages else 0
        if top > self.high_water:
            if self.on_grow is not None and not self.on_grow(top):
                for p in pages:
                    heapq.heappush(self._free, p)
                raise OutOfPages(f"no memory for pages {self.high_water} to {top - 1}")
            self.high_water = top
        for p in pages:
            self._refs[p] = 1
        return pages

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        heap = self._free
        if any(heap[(i - 1) // 2] > heap[i] for i in range(1, len(heap))):
            raise AssertionError("the free list is not a min-heap")
        if any(p >= self.high_water for p, r in enumerate(self._refs) if r > 0):
            raise AssertionError(f"a page at or past the high-water mark {self.high_water} is in use")
        for p, r in enumerate(self._refs):
            if r < 0:
                raise AssertionError(f"page {p} has a negative reference count")
            if (r == 0) != (p in free):
                raise AssertionError(
                    f"page {p}: refcount {r} but {'on' if p in free else 'off'} the free list"
                )


class HasPages(Protocol):
    pages: list[int]


class RequestPages:
    """Grows and frees requests' page lists, counted in tokens: what schedulers allocate through.

    Works on anything with a `pages: list[int]` (a Request); no model and no KV tensor involved.
    """

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def free_tokens(self) -> int:
        return self.allocator.num_free * self.page_size

    def reserve(self, req: HasPages, num_tokens: int) -> bool:
        """Grow `req.pages` to hold `num_tokens`; False (nothing allocated) when the pool is short, or
        when the memory behind pages never used before cannot be had (the allocator's `on_grow`): the
        request waits as for a full pool, until pages already backed come free."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if not self.allocator.can_alloc(need):
            return False
        try:
            req.pages.extend(self.allocator.alloc(need))
        except OutOfPages:
            return False
        return True

    def release(self, req: HasPages) -> None:
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
