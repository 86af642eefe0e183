"""The prefix cache with no model: a page allocator, token ids, and a fake pool recording which tokens
each page holds (so a page reused while a request still reads it shows up as wrong contents)."""

from __future__ import annotations

import random

import pytest

from pdserve.protocol.block_hash import block_hashes
from pdserve.runtime.kv_pool import PageAllocator
from pdserve.runtime.radix_cache import PrefixMatch, RadixCache

PAGE = 4


def make(num_pages: int = 32) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, PAGE)


def compute(alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """Pages for `tokens` as a request would hold them after computing their KV."""
    return alloc.alloc(-(-len(tokens) // PAGE))


def cache_prompt(alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> list[int]:
    """A request with no cache hit computes `tokens` and leaves its whole pages in the cache."""
    pages = compute(alloc, tokens)
    n = len(tokens) // PAGE
    cache.insert(tokens[: n * PAGE], pages[:n])
    alloc.free(pages[n:])
    cache.check_invariants()
    return pages[:n]


def test_match_takes_whole_pages_and_leaves_one_token_to_compute():
    alloc, cache = make()
    assert cache.match(list(range(10))).num_tokens == 0
    pages = cache_prompt(alloc, cache, list(range(10)))  # 2 whole pages cached, 2 tokens dropped
    assert len(pages) == 2 and cache.num_pages == 2

    m = cache.match(list(range(9)))  # 9 tokens: both pages would leave 1 token to compute
    assert (m.num_tokens, m.pages) == (8, pages)
    same = cache.match(list(range(8)))  # exactly the cached tokens: the last page must be recomputed
    assert (same.num_tokens, same.pages) == (4, pages[:1])
    other = cache.match([0, 1, 2, 99, 4, 5, 6, 7, 8])  # differs inside the first page: no hit
    assert (other.num_tokens, other.pages) == (0, [])
    tiny = cache.match([7])
    assert (tiny.num_tokens, tiny.pages) == (0, [])
    for x in (m, same, other, tiny):
        cache.release(x)
        alloc.free(x.pages)
    cache.check_invariants()


def test_match_takes_references_and_locks_until_release():
    alloc, cache = make()
    pages = cache_prompt(alloc, cache, list(range(12)))
    m = cache.match(list(range(13)))
    assert m.pages == pages and all(alloc.refcount(p) == 2 for p in pages)  # the tree's + the request's
    cache.check_invariants()
    assert cache.evictable_pages == 0 and cache.evict(3) == 0  # locked: nothing may go
    assert cache.num_pages == 3
    cache.release(m)
    with pytest.raises(ValueError, match="already released"):
        cache.release(m)
    alloc.free(m.pages)
    cache.check_invariants()
    assert cache.evictable_pages == 3 and cache.evict(3) == 3
    assert cache.num_pages == 0 and alloc.num_free == alloc.num_pages
    cache.check_invariants()


def test_partial_match_splits_a_node_and_keeps_the_shared_pages():
    alloc, cache = make()
    a = cache_prompt(alloc, cache, list(range(12)))  # one node of 3 pages
    b_tokens = list(range(8)) + [50, 51, 52, 53]
    m = cache.match(b_tokens + [54])
    assert (m.num_tokens, m.pages) == (8, a[:2])
    cache.check_invariants()  # the split node's lock and pages are consistent
    # b computes its third page and caches it next to a's: the shared two pages are not duplicated.
    b3 = alloc.alloc(1)
    cache.release(m)
    cache.insert(b_tokens, m.pages + b3)
    cache.check_invariants()
    assert cache.num_pages == 4
    assert cache.match(list(range(12)) + [0]).pages == a
    assert cache.match(b_tokens + [0]).pages == a[:2] + b3


def test_insert_frees_pages_whose_tokens_are_already_cached():
    alloc, cache = make()
    tokens = list(range(16))
    first = cache_prompt(alloc, cache, tokens)
    free_before = alloc.num_free
    # A second request computed the same prompt before the first was cached: its pages are duplicates.
    dup = compute(alloc, tokens)
    assert cache.insert(tokens, dup) == 0
    assert alloc.num_free == free_before and all(alloc.refcount(p) == 0 for p in dup)
    assert cache.num_pages == 4 and cache.match(tokens + [1]).pages == first
    # A longer one: its first 4 pages are duplicates, the 5th is new to the tree.
    longer = compute(alloc, tokens + [7] * PAGE)
    assert cache.insert(tokens + [7] * PAGE, longer) == 1
    assert cache.num_pages == 5 and all(alloc.refcount(p) == 0 for p in longer[:4])
    with pytest.raises(ValueError, match="token ids for"):
        cache.insert([1, 2, 3], alloc.alloc(1))


def test_eviction_is_lru_over_leaves_and_trims_from_the_end():
    alloc, cache = make()
    old = cache_prompt(alloc, cache, [1] * 12)
    new = cache_prompt(alloc, cache, [2] * 12)
    cache.release(cache.match([1] * 13))  # touching `old` makes `new` the least recently used
    alloc.free(old)  # the match's references
    assert cache.evict(2) == 2
    cache.check_invariants()
    assert cache.match([2] * 13).pages == new[:1]  # `new` lost its last two pages
    assert cache.match([1] * 13).pages == old
    assert all(alloc.refcount(p) == 0 for p in new[1:])


def test_eviction_frees_a_parent_once_its_children_are_gone():
    alloc, cache = make()
    cache_prompt(alloc, cache, [1] * 8)
    cache_prompt(alloc, cache, [1] * 8 + [2] * 4)
    cache_prompt(alloc, cache, [1] * 8 + [3] * 4)
    assert cache.num_pages == 4
    assert cache.evict(100) == 4
    assert cache.num_pages == 0 and alloc.num_free == alloc.num_pages
    cache.check_invariants()


def test_flush_only_when_nothing_is_held():
    alloc, cache = make()
    cache_prompt(alloc, cache, list(range(8)))
    m = cache.match(list(range(9)))
    with pytest.raises(RuntimeError, match="hold"):
        cache.flush()
    cache.release(m)
    alloc.free(m.pages)
    cache.flush()
    cache.check_invariants()
    assert cache.num_pages == 0 and alloc.num_free == alloc.num_pages
    assert cache.match(list(range(9))).num_tokens == 0


def test_check_invariants_catches_a_leaked_reference():
    alloc, cache = make()
    pages = cache_prompt(alloc, cache, list(range(8)))
    alloc.incref(pages[:1])  # a holder the cache does not know about
    with pytest.raises(AssertionError, match="refcount"):
        cache.check_invariants()


@pytest.mark.parametrize("seed", range(8))
def test_random_requests_keep_every_invariant(seed):
    """Requests arrive (match + allocate, evicting when short), finish (insert + release) or fail, and
    the cache is evicted at random; invariants are checked after every step. The fake pool records
    what each page holds: an eviction that took a page a request holds would show as wrong tokens."""
    rng = random.Random(seed)
    alloc, cache = make(num_pages=24)
    pool: dict[int, tuple[int, ...]] = {}  # page -> the token ids whose KV it holds
    live: list[tuple[list[int], list[int], PrefixMatch]] = []  # (tokens, pages, match)
    bases = [[rng.randrange(3) for _ in range(20)] for _ in range(3)]  # shared prefixes

    def check_live() -> None:
        for tokens, pages, _ in live:
            for i, p in enumerate(pages):
                assert alloc.refcount(p) >= 1, "a page a request holds went back to the free list"
                want = tuple(tokens[i * PAGE : (i + 1) * PAGE])
                assert pool[p][: len(want)] == want, "a page a request holds was overwritten"

    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            base = rng.choice(bases)
            tokens = base[: rng.randrange(1, 21)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
            m = cache.match(tokens)
            assert m.num_tokens % PAGE == 0 and m.num_tokens < len(tokens)
            for i, p in enumerate(m.pages):
                assert pool[p] == tuple(tokens[i * PAGE : (i + 1) * PAGE]), "the cache served wrong KV"
            need = -(-len(tokens) // PAGE) - len(m.pages)
            if need > alloc.num_free:
                cache.evict(need - alloc.num_free)
            if need > alloc.num_free:  # still short: the request does not start
                cache.release(m)
                alloc.free(m.pages)
            else:
                new = alloc.alloc(need)
                pages = m.pages + new
                for i in range(len(m.pages), len(pages)):
                    pool[pages[i]] = tuple(tokens[i * PAGE : (i + 1) * PAGE])
                live.append((tokens, pages, m))
        elif op < 0.85 and live:
            tokens, pages, m = live.pop(rng.randrange(len(live)))
            cache.release(m)
            if rng.random() < 0.8:  # finished: whole pages cached
                n = len(tokens) // PAGE
                cache.insert(tokens[: n * PAGE], pages[:n])
                alloc.free(pages[n:])
            else:  # failed: everything freed
                alloc.free(pages)
        else:
            held = {p for _, pages, _ in live for p in pages}
            tree_before = cache.num_pages
            freed = cache.evict(rng.randrange(1, 6))
            assert cache.num_pages == tree_before - freed
            assert all(alloc.refcount(p) >= 1 for p in held)
        cache.check_invariants()
        check_live()
    for _, pages, m in live:
        cache.release(m)
        alloc.free(pages)
    cache.flush()
    cache.check_invariants()
    assert alloc.num_free == alloc.num_pages


def test_events_name_pages_as_the_gateway_hashes_them():
    """What the tree stores, evicts and flushes comes out as the block hashes the gateway computes for
    the same prompt, so the gateway's index mirrors the tree."""
    alloc = PageAllocator(32)
    cache = RadixCache(alloc, PAGE, record_events=True)
    a, b = list(range(12)), list(range(8)) + [50, 51, 52, 53]  # share two pages, differ in the third
    cache_prompt(alloc, cache, a)
    stored, removed = cache.take_events()
    assert stored == block_hashes(a, PAGE) and removed == []
    cache_prompt(alloc, cache, b)  # splits a's node: only b's own third page is new
    stored, removed = cache.take_events()
    assert stored == block_hashes(b, PAGE)[2:] and removed == []
    mirror = set(block_hashes(a, PAGE)) | set(block_hashes(b, PAGE))
    assert set(cache.block_snapshot()) == mirror and len(cache.block_snapshot()) == 4
    assert cache.evict(1) == 1  # the least recently used leaf: a's third page
    stored, removed = cache.take_events()
    assert stored == [] and removed == [block_hashes(a, PAGE)[2]]
    assert set(cache.block_snapshot()) == set(block_hashes(b, PAGE))
    cache.flush()
    assert sorted(cache.take_events()[1]) == sorted(block_hashes(b, PAGE))
    assert cache.block_snapshot() == [] and cache.take_events() == ([], [])
    cache.check_invariants()


def test_invalidate_forgets_everything_and_frees_locked_pages_at_release():
    """A weight update: no later match finds old pages; pages a request still holds stay until it lets go."""
    alloc, cache = make()
    cache_prompt(alloc, cache, list(range(16)))  # 4 pages
    cache_prompt(alloc, cache, [99] * 8)  # 2 pages, never locked
    held = cache.match(list(range(13)))  # 3 pages locked by a running request
    assert held.num_tokens == 12
    empty = cache.match([5])  # a match of no tokens, ending at the root
    cache.invalidate()
    cache.check_invariants()
    assert cache.num_pages == 0 and cache.evictable_pages == 0
    assert cache.match(list(range(16))).num_tokens == 0  # nothing of the old weights is served
    # The unlocked pages went back at once; the 3 locked ones are the request's and the old tree's.
    assert all(alloc.refcount(p) == 2 for p in held.pages)
    cache.release(held)
    cache.release(empty)
    alloc.free(held.pages)  # the request frees its own references
    cache.check_invariants()
    assert alloc.num_free == alloc.num_pages
    # New pages under the same tokens are cached again from scratch.
    cache_prompt(alloc, cache, list(range(16)))
    assert cache.match(list(range(17))).num_tokens == 16
