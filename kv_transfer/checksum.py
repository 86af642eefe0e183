"""KV checksums: what the prefill node hashed is what the decode node holds, or the room fails.

The sender hashes the pages it hands off (xxh3-64 over each page's bytes, right before they leave:
after a TP worker gathered its ranks' heads, before the announcement) and sends the hashes in the
trailer (protocol/kv_trailer.py) as [index in the room's page list, hash] pairs. The receiver hashes
the same pages where they landed, after its copy and before the room goes running; any difference fails
the room with `KV_CORRUPT`, which the decode worker reports as `FailCode.KV_CORRUPT` (the gateway runs
the request again elsewhere, as a failed transfer).

Modes (`--kv-checksum`): `all` hashes every page; `sample` the first, the last and every
SAMPLE_STRIDE-th page between (a prompt of up to 2 pages entirely; a flipped byte in a random page of a
long one is caught with probability about 1/SAMPLE_STRIDE, a run of pages overwritten when it covers a
hashed one); `off` none. The receiver checks whatever the trailer lists, so the two sides need not
agree on the mode. Their cost (docs/benchmarks.md, `pdserve bench transfer --kv-checksum`): at 4,096
tokens `sample` hashes 0.27 ms a side, 1.7% of a same-host hand-off; `all` 18.7 ms a side, +117% of
a same-host hand-off and +50% of one over the pair group.

What it covers: any change to a page's bytes between the sender's hash and the receiver's check (the
pair group's bytes, the shared-memory segment, a page the prefill node reused or overwrote too early).
What it does not: KV computed wrong in the first place (the canaries' job, gateway/autopilot/canary.py).
"""

from __future__ import annotations

import torch
import xxhash

SAMPLE_STRIDE = 128
KV_CORRUPT = "KV checksum mismatch"  # the start of a corrupt room's error (kv_transfer's callers match it)


def checked_indices(num_pages: int, mode: str) -> list[int]:
    """Which of a room's `num_pages` transferred pages `mode` hashes, in order."""
    if mode == "off" or num_pages == 0:
        return []
    if mode == "all":
        return list(range(num_pages))
    return sorted({0, num_pages - 1, *range(SAMPLE_STRIDE, num_pages, SAMPLE_STRIDE)})


def page_hashes(kv: torch.Tensor, pages: list[int], indices: list[int]) -> list[tuple[int, int]]:
    """[(i, xxh3-64 of page pages[i]'s bytes)] for each i of `indices`; `kv` is a pool [N, ...] whose
    pages are contiguous blocks (a CUDA pool's pages are copied to the host first)."""
    if not indices:
        return []
    ids = torch.tensor([pages[i] for i in indices], dtype=torch.long, device=kv.device)
    block = kv.index_select(0, ids) if kv.is_cuda else None
    out = []
    for j, i in enumerate(indices):
        page = block[j].cpu() if block is not None else kv[pages[i]]
        out.append((i, xxhash.xxh3_64_intdigest(page.view(torch.uint8).numpy().data)))
    return out


def mismatch(kv: torch.Tensor, pages: list[int], expected: list[tuple[int, int]]) -> str | None:
    """None when every listed page of `pages` in `kv` hashes as `expected` says; else the error, naming
    the pages that differ (indices in the room's page list)."""
    if not expected:
        return None
    if any(not 0 <= i < len(pages) for i, _ in expected):
        return f"{KV_CORRUPT}: the trailer lists pages outside the room's {len(pages)}"
    got = page_hashes(kv, pages, [i for i, _ in expected])
    bad = [i for (i, want), (_, have) in zip(expected, got) if want != have]
    if not bad:
        return None
    return (
        f"{KV_CORRUPT} in {len(bad)} of {len(expected)} checked pages (first: page {bad[0]} of {len(pages)})"
    )
