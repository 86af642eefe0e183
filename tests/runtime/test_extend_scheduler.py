"""Admission and chunked prefill with no model: an allocator, requests, and forwards faked as
`num_computed += len(chunk)` (what ModelRunner.forward does to the bookkeeping)."""

from __future__ import annotations

import pytest

from pdserve.runtime.extend_scheduler import ExtendScheduler
from pdserve.runtime.kv_pool import PageAllocator, RequestPages
from pdserve.runtime.radix_cache import RadixCache
from pdserve.runtime.request import Request, RequestState
from pdserve.sampling_params import SamplingParams

PAGE = 4


def make_sched(num_pages: int, budget: int = 8, max_requests: int = 8) -> ExtendScheduler:
    return ExtendScheduler(
        RequestPages(PageAllocator(num_pages), PAGE), budget, max_requests, lambda r: len(r.prompt_ids)
    )


def req(i: int, prompt_len: int) -> Request:
    return Request(f"r{i}", list(range(100 * i, 100 * i + prompt_len)), SamplingParams(max_new_tokens=4))


def fake_forward(reqs: list[Request], chunks: list[list[int]]) -> None:
    for r, c in zip(reqs, chunks):
        assert c == r.prompt_ids[r.num_computed : r.num_computed + len(c)], "chunks must continue the prompt"
        assert len(r.pages) * PAGE >= r.num_computed + len(c), "KV written past the request's pages"
        r.num_computed += len(c)


def test_chunks_fill_the_token_budget_unfinished_prompts_first():
    sched = make_sched(num_pages=100, budget=8)
    a, b, c = req(0, 5), req(1, 12), req(2, 3)
    for r in (a, b, c):
        sched.add(r)
    reqs, chunks = sched.schedule()
    assert reqs == [a, b] and [len(x) for x in chunks] == [5, 3]
    assert a.state is b.state is RequestState.PREFILLING and c.state is RequestState.QUEUED
    fake_forward(reqs, chunks)
    assert sched.take_completed(reqs) == ([a], [0])
    assert a.state is RequestState.PREFILLING and a.pages  # the caller moves it on; pages held
    reqs, chunks = sched.schedule()
    assert reqs == [b] and chunks == [b.prompt_ids[3:11]]  # b's rest first; no budget left for c
    fake_forward(reqs, chunks)
    assert sched.take_completed(reqs) == ([], [])
    reqs, chunks = sched.schedule()
    assert reqs == [b, c] and [len(x) for x in chunks] == [1, 3]
    fake_forward(reqs, chunks)
    assert sched.take_completed(reqs) == ([b, c], [0, 1])
    assert len(sched) == 0


def test_admission_waits_for_pages_and_slots():
    sched = make_sched(num_pages=5, budget=100, max_requests=2)
    a, b, c = req(0, 12), req(1, 12), req(2, 1)  # 3 pages each for a and b
    for r in (a, b, c):
        sched.add(r)
    reqs, _ = sched.schedule()
    assert reqs == [a]  # b does not fit; c waits behind b (first come, first served)
    assert b.pages == [] and b.state is RequestState.QUEUED
    assert sched.schedule(occupied=1)[0] == [a]  # a slot held elsewhere: still nothing new
    sched.retire(a, RequestState.FAILED)  # abort mid-prefill: pages back
    assert a.pages == [] and a.state is RequestState.FAILED
    reqs, _ = sched.schedule()
    assert reqs == [b, c]
    assert sched.pages.allocator.num_free == 1
    sched.pages.allocator.check_invariants()


def test_hand_off_then_retire_frees_pages():
    sched = make_sched(num_pages=10)
    a, q = req(0, 4), req(1, 4)
    sched.add(a)
    fake_forward(*sched.schedule())
    assert sched.take_completed([a]) == ([a], [0])
    sched.hand_off(a)
    assert a.state is RequestState.TRANSFERRING and len(a.pages) == 1  # held while the KV is sent
    sched.retire(a, RequestState.FINISHED)
    assert a.state is RequestState.FINISHED and a.pages == []
    sched.add(q)
    sched.retire(q, RequestState.FAILED)  # aborted while queued
    assert len(sched) == 0 and sched.pages.allocator.num_free == 10
    with pytest.raises(ValueError, match="only FINISHED or FAILED"):
        sched.retire(req(2, 1), RequestState.RUNNING)
    with pytest.raises(ValueError, match="not QUEUED"):
        sched.add(a)


def make_cached_sched(num_pages: int, budget: int = 100) -> ExtendScheduler:
    alloc = PageAllocator(num_pages)
    return ExtendScheduler(
        RequestPages(alloc, PAGE), budget, 8, lambda r: len(r.prompt_ids), cache=RadixCache(alloc, PAGE)
    )


def run_to_retire(sched: ExtendScheduler, r: Request) -> None:
    sched.add(r)
    fake_forward(*sched.schedule())
    assert sched.take_completed([r]) == ([r], [0])
    sched.hand_off(r)
    sched.retire(r, RequestState.FINISHED)


def test_admission_starts_on_the_cached_prefix_and_retire_caches_prompt_pages():
    sched = make_cached_sched(num_pages=10)
    assert sched.cache is not None
    a = Request("a", list(range(10)), SamplingParams())
    sched.add(a)
    assert a.cached_tokens == 0
    fake_forward(*sched.schedule())
    assert sched.take_completed([a]) == ([a], [0])
    a_pages = list(a.pages)
    sched.hand_off(a)
    assert sched.cache.num_pages == 0  # the KV is still on its way out: not cached yet
    sched.retire(a, RequestState.FINISHED)
    assert sched.cache.num_pages == 2 and sched.pages.allocator.num_free == 8  # the partial page freed

    b = Request("b", list(range(8)) + [77, 78], SamplingParams())
    sched.add(b)
    reqs, chunks = sched.schedule()
    assert reqs == [b] and chunks == [[77, 78]]  # only the uncached rest is computed
    assert (b.num_computed, b.cached_tokens, b.pages[:2]) == (8, 8, a_pages[:2])
    sched.cache.check_invariants()
    fake_forward(reqs, chunks)
    sched.retire(b, RequestState.FAILED)  # aborted: its computed whole pages are still cached
    sched.cache.check_invariants()
    assert sched.cache.num_pages == 2 and sched.pages.allocator.num_free == 8


def test_admission_evicts_unlocked_cached_pages_when_short():
    sched = make_cached_sched(num_pages=6)
    assert sched.cache is not None
    run_to_retire(sched, Request("a", [1] * 8 + [2], SamplingParams()))
    run_to_retire(sched, Request("b", [3] * 8 + [4], SamplingParams()))
    assert sched.cache.num_pages == 4 and sched.pages.allocator.num_free == 2
    assert sched.free_tokens == 6 * PAGE  # cached pages count as allocatable

    c = Request("c", [1] * 8 + [5] * 8, SamplingParams())  # 4 pages: 2 cached, 2 free
    sched.add(c)
    assert sched.schedule()[0] == [c] and c.cached_tokens == 8
    d = Request("d", [6] * 9, SamplingParams())  # 3 pages: only b's 2 cached pages are evictable
    sched.add(d)
    assert sched.schedule()[0] == [c]  # d waits, and nothing was evicted for it in vain
    assert sched.cache.num_pages == 4 and d.pages == [] and d.num_computed == 0
    sched.cache.check_invariants()
    sched.retire(c, RequestState.FAILED)  # c's prefix unlocked: a's pages may go now
    reqs, _ = sched.schedule()
    assert reqs == [d] and d.cached_tokens == 0
    sched.cache.check_invariants()
    assert sched.pages.allocator.num_free + sched.cache.num_pages + len(d.pages) == 6
