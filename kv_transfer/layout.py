"""Byte layout of the KV hand-off: the one place that knows how pages become bytes on the wire.

Pool:  kv[num_pages, num_layers, 2 (K=0, V=1), page_size, kv_heads, head_dim], contiguous: page-major,
so each page is one contiguous block of page_bytes. A request's token i lives in page
pages[i // page_size] at offset i % page_size; pages move whole.

Wire format of one transfer (all over the pair's process group, in this order):
  1. ceil(n_pages / chunk_pages) chunks; chunk c carries pages [c*chunk_pages, ...) of the request as
     the C-contiguous tensor kv[chunk_page_ids] of shape [c_pages, L, 2, P, H, D] in the pool's
     dtype, native byte order, sent as raw uint8 (the pages' blocks back to back).
     Or, when both page lists run consecutively in long enough stretches (`direct_runs`), the pieces
     of those runs straight from the sender's pool into the receiver's: piece r is kv[first:first + n]
     on each side, no staging copy at all. The announcement says which of the two it is.
  2. the trailer (pdserve.protocol.kv_trailer), raw uint8. The receiver commits only if the trailer's
     room equals the room announced on the control channel.
The chunk size and trailer length travel in the control-plane announcement (protocol.kv_control.Announce)
that precedes the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# The layout above, as the compatibility record names it (pdserve/protocol/compat.py): a change to it is a
# new name.
KV_LAYOUT = "page-major[N,L,2,P,H,D]"

# Tags of one transfer: base tag per transfer sequence number, plus the chunk index; the trailer uses
# the last slot. Distinct tags make a desynchronised pair time out instead of mixing rooms.
MAX_CHUNKS = 1023
_TAG_STRIDE = MAX_CHUNKS + 1


@dataclass(frozen=True)
class PoolGeometry:
    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one page across the pool: [L, 2, P, H, D]."""
        return (self.num_layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * torch.empty((), dtype=self.dtype).element_size()


def kv_head_ranges(num_kv_heads: int, tp_size: int) -> list[range]:
    """The KV heads each rank of a TP worker holds in its pool (Megatron's split, runtime/tp_layout.py):
    consecutive equal shares, or with fewer heads than ranks each head on tp_size / num_kv_heads
    consecutive ranks. A split that is not even raises ValueError (`split_error`)."""
    error = split_error(num_kv_heads, tp_size)
    if error is not None:
        raise ValueError(error)
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return [range(r * per, (r + 1) * per) for r in range(tp_size)]
    return [range(r * num_kv_heads // tp_size, r * num_kv_heads // tp_size + 1) for r in range(tp_size)]


def split_error(num_kv_heads: int, tp_size: int) -> str | None:
    """Why `tp_size` ranks cannot hold `num_kv_heads` KV heads in even shares; None if they can."""
    if tp_size < 1 or num_kv_heads < 1:
        return f"TP {tp_size} over {num_kv_heads} KV heads is not a layout"
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return f"TP {tp_size} does not split {num_kv_heads} KV heads (neither divides the other)"
    return None


def describe_split(num_kv_heads: int, tp_size: int) -> str:
    """e.g. 'TP 2 (KV heads 0-1 | 2-3)', or the reason it is no layout."""
    error = split_error(num_kv_heads, tp_size)
    if error is not None:
        return f"TP {tp_size} ({error})"
    parts = [
        f"{h.start}-{h.stop - 1}" if len(h) > 1 else str(h.start)
        for h in kv_head_ranges(num_kv_heads, tp_size)
    ]
    return f"TP {tp_size} (KV heads {' | '.join(parts)})"


def mapping_error(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> str | None:
    """Why KV of a prefill of TP `prefill_tp` cannot land on a decode of TP `decode_tp`, naming both
    layouts; None when every decode rank's heads are held by some prefill rank."""
    if split_error(num_kv_heads, prefill_tp) is None and split_error(num_kv_heads, decode_tp) is None:
        return None
    return (
        f"cannot map prefill layout {describe_split(num_kv_heads, prefill_tp)} "
        f"to decode layout {describe_split(num_kv_heads, decode_tp)}"
    )


def pool_tensor(kv: Any) -> torch.Tensor:
    """Accept the pool tensor itself or an object holding it as `.kv`."""
    tensor = kv if isinstance(kv, torch.Tensor) else getattr(kv, "kv", None)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a KV pool tensor or an object with a .kv tensor, got {type(kv).__name__}")
    return tensor


def geometry_of(kv: torch.Tensor) -> PoolGeometry:
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ValueError(
            f"KV pool must be [pages, layers, 2, page_size, kv_heads, head_dim], got {tuple(kv.shape)}"
        )
    if not kv.is_contiguous():
        raise ValueError("KV pool must be contiguous")
    pages, layers, _, page_size, heads, head_dim = kv.shape
    return PoolGeometry(layers, pages, page_size, heads, head_dim, kv.dtype)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def chunk_pages(geometry: PoolGeometry, num_pages: int, chunk_bytes: int) -> int:
    """Pages per chunk: as many as fit in chunk_bytes (at least one), and at most MAX_CHUNKS chunks."""
    per_chunk = max(1, chunk_bytes // geometry.page_bytes)
    return max(per_chunk, pages_for(num_pages, MAX_CHUNKS))


def chunk_ranges(num_pages: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + per_chunk, num_pages)) for start in range(0, num_pages, per_chunk)]


def direct_runs(
    src: list[int], dst: list[int], max_pages: int, min_bytes: int, page_bytes: int
) -> list[int] | None:
    """Piece lengths (at most max_pages each) over which src and dst both run consecutively, if they
    average at least min_bytes and number at most MAX_CHUNKS; None means: use staged chunks."""
    runs: list[int] = []
    n = 0
    for i in range(len(src)):
        if n and (src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1 or n == max_pages):
            runs.append(n)
            n = 0
        n += 1
    if n:
        runs.append(n)
    if not runs or len(runs) > MAX_CHUNKS or len(src) * page_bytes < min_bytes * len(runs):
        return None
    return runs


def runs_fit(pages: list[int], runs: list[int]) -> bool:
    """Whether `pages` run consecutively over every piece of `runs` (the receiver's own check)."""
    return all(
        pages[at : at + n] == list(range(pages[at], pages[at] + n)) for at, n in zip(run_starts(runs), runs)
    )


def run_starts(runs: list[int]) -> list[int]:
    """Index in the page list of each run's first page."""
    starts, at = [], 0
    for n in runs:
        starts.append(at)
        at += n
    return starts


def chunk_tag(seq: int, chunk: int) -> int:
    return (seq % (1 << 20)) * _TAG_STRIDE + chunk


def trailer_tag(seq: int) -> int:
    return chunk_tag(seq, MAX_CHUNKS)


def chunk_view(flat: torch.Tensor, geometry: PoolGeometry, n_pages: int) -> torch.Tensor:
    """View the first n_pages pages' worth of a flat uint8 staging buffer as [n, L, 2, P, H, D]."""
    nbytes = n_pages * geometry.page_bytes
    typed = flat[:nbytes].view(geometry.dtype)
    return typed.view(n_pages, *geometry.page_shape)


def _as_blocks(t: torch.Tensor) -> torch.Tensor:
    """[n, L, 2, P, H, D] -> [n, words]: one row per page, in 8-byte words when a page allows, which
    makes index_select / index_copy_ plain block copies."""
    blocks = t.view(t.shape[0], -1)
    if (blocks.shape[1] * blocks.element_size()) % 8 == 0:
        return blocks.view(torch.uint8).view(torch.int64)
    return blocks


def gather_pages(kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, L, 2, P, H, D] = kv[page_ids]; page_ids on kv's device, out contiguous."""
    torch.index_select(_as_blocks(kv), 0, page_ids, out=_as_blocks(out))


def scatter_pages(kv: torch.Tensor, page_ids: torch.Tensor, buf: torch.Tensor) -> None:
    """kv[page_ids] = buf[n, L, 2, P, H, D]; page_ids on kv's device, buf contiguous."""
    _as_blocks(kv).index_copy_(0, page_ids, _as_blocks(buf))
