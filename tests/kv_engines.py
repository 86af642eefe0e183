"""What the in-process KV transfer tests share: a fingerprint, random pools and waiting for results."""

from __future__ import annotations

import time

import torch

FP = {"architecture": "TestLM", "page_size": 4, "weights_hash": "h"}


def random_pool(pages: int, seed: int) -> torch.Tensor:
    """A KV pool of `pages` pages: 2 layers, K and V, 4 tokens a page, 2 heads of 8 ([N,L,2,P,H,D])."""
    return torch.randn(pages, 2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(seed))


def wait_results(engine, rooms: set[str], timeout: float = 10.0) -> dict:
    """The results `engine.poll()` reports for `rooms`, by room; fails if any is missing at the timeout."""
    got, deadline = {}, time.monotonic() + timeout
    while set(got) != rooms and time.monotonic() < deadline:
        got.update({r.room: r for r in engine.poll()})
        time.sleep(0.005)
    assert set(got) == rooms, f"missing results for {rooms - set(got)}"
    return got
