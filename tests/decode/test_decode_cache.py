"""The decode node's prefix cache: what admission reuses, what retirement leaves, what is never evicted."""

from __future__ import annotations

import random

import pytest

from pdserve.config import RuntimeConfig
from pdserve.decode.scheduler import DecodeScheduler
from pdserve.decode.stepper import PlainStepper
from pdserve.protocol.block_hash import block_hashes
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.kv_pool import PageAllocator, RequestPages
from pdserve.runtime.radix_cache import RadixCache
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner, append_samples
from pdserve.sampling_params import SamplingParams

PAGE = 4


def make(num_pages: int, max_running: int = 8, lookahead: int = 1) -> tuple[DecodeScheduler, RadixCache]:
    alloc = PageAllocator(num_pages)
    cache = RadixCache(alloc, PAGE)
    return DecodeScheduler(RequestPages(alloc, PAGE), max_running, lookahead, cache), cache


def req(room: str, prompt: list[int], max_new: int) -> Request:
    return Request(room, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def finish(sched: DecodeScheduler, r: Request, outputs: list[int]) -> None:
    """Arrive (as a transfer would) and decode `outputs`, writing each token's KV before the next."""
    assert sched.kv_arrived(r.room) is r
    for t in outputs:
        r.num_computed = r.num_tokens
        r.append_token(t)
        assert sched.grow_or_retract() == []
    sched.retire_finished()


def test_a_second_turn_skips_the_whole_pages_of_the_first_turns_prompt_and_output():
    sched, cache = make(64)
    first = req("t1", list(range(1, 11)), 6)  # 10 prompt tokens + 6 output tokens
    sched.add(first)
    assert sched.admit() == [first] and sched.skip(first) == (0, None)
    finish(sched, first, [50, 51, 52, 53, 54, 55])
    cache.check_invariants()
    # KV is written for every token but the newest: 15 tokens, 3 whole pages, are cached.
    history = first.prompt_ids + first.output_ids
    assert cache.num_pages == 3

    second = req("t2", history + [60, 61, 62], 4)
    sched.add(second)
    assert sched.admit() == [second]
    skip, prefix_hash = sched.skip(second)
    assert (skip, second.cached_tokens) == (3, 12)
    assert prefix_hash == block_hashes(history, PAGE)[2]  # what the prefill node checks
    cache.check_invariants()
    # The cached pages are locked: an eviction cannot take them while the request holds them.
    assert cache.evict(10) == 0
    finish(sched, second, [70, 71, 72, 73])
    cache.check_invariants()


def test_a_refused_prefix_requeues_the_request_for_a_full_transfer():
    sched, cache = make(64)
    first = req("t1", list(range(1, 18)), 1)
    sched.add(first)
    sched.admit()
    finish(sched, first, [99])
    second = req("t2", list(range(1, 18)) + [5, 6], 2)
    sched.add(second)
    sched.admit()
    assert sched.skip(second)[0] == 4
    assert sched.prefix_refused("t2") is second
    assert second.state is RequestState.QUEUED and second.pages == [] and second.cached_tokens == 0
    cache.check_invariants()
    assert sched.admit() == [second]
    assert sched.skip(second) == (0, None)  # asked again in full
    assert len(second.pages) >= 5
    finish(sched, second, [1, 2])
    cache.check_invariants()


def test_cached_pages_are_evicted_before_a_running_request_is_retracted():
    sched, cache = make(12)
    old = req("old", list(range(100, 120)), 1)
    sched.add(old)
    sched.admit()
    finish(sched, old, [1])
    assert cache.num_pages == 5
    # 8 pages needed now: 7 free + cached ones evicted, no retraction.
    r = req("new", list(range(1, 30)), 3)
    sched.add(r)
    assert sched.admit() == [r]
    assert sched.free_tokens == (sched.pages.allocator.num_free + cache.evictable_pages) * PAGE
    cache.check_invariants()
    assert sched.kv_arrived("new") is r
    assert sched.grow_or_retract() == []
    cache.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_random_lives_keep_the_tree_and_the_allocator_consistent(seed):
    """Random arrivals sharing prefixes, transfers ending either way, refusals, aborts, retractions
    and finishes on a small pool: after every step, references, locks and counts all agree."""
    rng = random.Random(seed)
    sched, cache = make(40, max_running=6, lookahead=2)
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    n = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 and len(sched) < 12:
            prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            sched.add(req(f"r{n}", prompt, rng.randrange(1, 12)), local_prefill=rng.random() < 0.2)
            n += 1
        for r in sched.admit():
            if r.state is RequestState.PREFILLING:
                r.num_computed = len(r.prompt_ids)
                r.append_token(7)
                sched.prefilled(r)
        for room in list(sched.transferring):
            x = rng.random()
            if x < 0.5:
                r = sched.kv_arrived(room)
                assert r is not None
                r.append_token(8)
            elif x < 0.6:
                sched.prefix_refused(room)
            elif x < 0.7:
                sched.kv_failed(room)
        if rng.random() < 0.1 and sched.running:
            sched.remove(rng.choice(sched.running).room)
        for r in sched.resume_retracted():
            r.num_computed = r.num_tokens - 1
        sched.grow_or_retract()
        for r in sched.running:
            if not r.finished:
                assert len(r.pages) * PAGE >= r.num_tokens
                r.num_computed = r.num_tokens
                r.append_token(rng.randrange(1000))
        sched.retire_finished()
        cache.check_invariants()
        held = {p for r in [*sched.running, *sched.transferring.values()] for p in r.pages}
        assert all(sched.pages.allocator.refcount(p) > 0 for p in held)


def test_local_prefill_on_cached_pages_matches_the_engine(bundled, make_engine):
    """A conversation's second turn computed here on top of the first turn's cached pages gives the
    same greedy tokens as an engine without any cache (fp32)."""
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    runner = ModelRunner(
        RuntimeConfig(device="cpu", max_total_tokens=1024, page_size=16, attention_backend="torch"), bundled
    )
    cache = RadixCache(runner.allocator, 16)
    sched = DecodeScheduler(runner.pages, max_running=8, lookahead=1, cache=cache)
    stepper = PlainStepper(runner)

    def run(r: Request) -> None:
        sched.add(r, local_prefill=True)
        (got,) = sched.admit()
        assert got is r and r.state is RequestState.PREFILLING
        logits = runner.forward(ForwardMode.EXTEND, [r], [r.prompt_ids[r.num_computed :]])
        append_samples([r], runner.sample([r], logits))
        sched.prefilled(r)
        while not r.finished:
            sched.grow_or_retract()
            stepper.step([r])
        sched.retire_finished()
        cache.check_invariants()

    first = Request("t1", list(range(300, 340)), params, runner.spec.eos_token_ids)
    run(first)
    history = first.prompt_ids + first.output_ids
    second = Request("t2", history + [504, 3575, 282], params, runner.spec.eos_token_ids)
    run(second)
    assert second.cached_tokens == 48  # 51 tokens with KV: 3 whole pages
    ref = make_engine(bundled, disable_radix_cache=True).generate([second.prompt_ids], params)
    assert second.output_ids == ref[0].output_ids
