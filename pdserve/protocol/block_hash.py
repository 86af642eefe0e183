"""Page-block hashes: how a prefill worker names the KV pages its prefix cache holds, and how the
gateway names a prompt's pages to look them up (`KVEvents` carries them; gateway.py).

A block is one whole page of token ids. Its hash chains the previous block's hash with the page's
token ids (as vLLM and Dynamo do), so equal hashes mean equal prefixes, not only equal pages.
blake2b over fixed-width bytes: the same value in every process and every Python (no `hash()`
randomisation), 63 bits so it stays a plain non-negative JSON integer anywhere.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0  # the "previous block" of a prompt's first page
_MASK = (1 << 63) - 1


def block_hash(parent: int, page_token_ids: Sequence[int]) -> int:
    """Hash of one page given the hash of the page before it (ROOT_HASH for the first page)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", page_token_ids).tobytes())
    return int.from_bytes(h.digest(), "little") & _MASK


def block_hashes(token_ids: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the whole pages of `token_ids` (a trailing partial page has none)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    out: list[int] = []
    for i in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[i : i + page_size])
        out.append(parent)
    return out
