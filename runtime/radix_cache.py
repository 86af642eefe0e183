"""The prefix cache: a radix tree over token ids at page granularity, on the ref-counted page allocator.

Only whole pages are cached. A node holds a run of pages and the token ids they hold (its key, a
multiple of page_size long); a node's children are keyed by the token ids of their first page, so
two children never start with the same page. A path from the root spells a cached prefix.

Reference counts (the invariant `check_invariants` checks): the tree holds exactly one allocator
reference on each of its pages, and each `match` holds one more on each page it matched, until the
caller frees them. `lock_ref` counts the matches whose path runs through a node; a node with
lock_ref > 0 is never evicted, so a page a request holds never goes back to the free list.

Life of a request's pages: `match` at admission (the cached prefix, locked and referenced), the
rest allocated as usual; when the request ends, `insert` takes over its whole prompt pages (pages
whose tokens are already cached are freed: deduplication), `release` drops the lock, and the caller
frees its remaining pages. `evict` frees least recently used unlocked leaves when the pool is short.

Block hashes: each node also keeps the chained hash of each of its pages (`pdserve.protocol.block_hash`:
the name a page has on the gateway). With `record_events`, the hashes of pages that enter the tree
and leave it are collected until `take_events` hands them over (the prefill worker publishes them).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

from pdserve.protocol.block_hash import ROOT_HASH, block_hashes
from pdserve.runtime.kv_pool import PageAllocator

Key = tuple[int, ...]


@dataclass(eq=False)
class _Node:
    key: Key  # token ids held by `pages`: len(key) == len(pages) * page_size
    pages: list[int]
    parent: _Node | None
    hashes: list[int] = field(default_factory=list)  # chained block hash of each page
    children: dict[Key, _Node] = field(default_factory=dict)  # first page's token ids -> child
    lock_ref: int = 0  # matches whose path runs through this node
    last_access: int = 0  # a tick of the cache's clock: LRU order for eviction
    stale: bool = False  # left the tree at `invalidate` while locked: its pages go when the last lock does


@dataclass(frozen=True, eq=False)
class PrefixMatch:
    """A cached prefix handed to a request: `num_tokens` tokens (whole pages) whose KV is in `pages`.

    The caller owns one allocator reference per page and must hand the match back to `release`."""

    num_tokens: int
    pages: list[int]
    node: _Node  # the deepest matched node; the lock runs from it to the root
    last_hash: int = ROOT_HASH  # block hash of the last matched page (what incremental transfer checks)


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, record_events: bool = False):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.allocator = allocator
        self.page_size = page_size
        self.root = _Node((), [], None)
        self._tick = itertools.count(1)
        self._held: Counter[_Node] = Counter()  # matches not yet released, by their deepest node
        self.num_pages = 0  # pages in the tree
        self._locked_pages = 0  # pages in nodes with lock_ref > 0
        self.record_events = record_events
        self._stored: list[int] = []  # block hashes that entered the tree since `take_events`
        self._removed: list[int] = []  # and those that left it

    @property
    def evictable_pages(self) -> int:
        return self.num_pages - self._locked_pages

    def take_events(self) -> tuple[list[int], list[int]]:
        """Block hashes (stored, removed) since the last call; a hash may be in both, in that order."""
        out = self._stored, self._removed
        self._stored, self._removed = [], []
        return out

    def block_snapshot(self) -> list[int]:
        """The block hash of every page in the tree."""
        return [h for n in self._nodes() for h in n.hashes]

    def match(self, prompt_ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of `prompt_ids` in whole pages, leaving at least the last token
        to compute (its logits are needed): at most (len - 1) rounded down to pages. Locks the matched
        nodes and takes one allocator reference per matched page for the caller."""
        ps = self.page_size
        usable = (len(prompt_ids) - 1) // ps * ps if prompt_ids else 0
        key = tuple(prompt_ids[:usable])
        node, i = self.root, 0
        pages: list[int] = []
        last_hash = ROOT_HASH
        now = next(self._tick)
        while i < len(key):
            child = node.children.get(key[i : i + ps])
            if child is None:
                break
            n = self._common_pages(child, key, i)
            if n < len(child.pages):
                child = self._split(child, n).parent
                assert child is not None
            child.last_access = now
            pages += child.pages
            last_hash = child.hashes[-1]
            i += len(child.key)
            node = child
        self._lock(node)
        self._held[node] += 1
        self.allocator.incref(pages)
        return PrefixMatch(i, pages, node, last_hash)

    def release(self, m: PrefixMatch) -> None:
        """Drop the lock `match` took (not the caller's page references: it frees those itself)."""
        if self._held[m.node] <= 0:
            raise ValueError("this prefix match was already released")
        self._held[m.node] -= 1
        if not self._held[m.node]:
            del self._held[m.node]
        node: _Node | None = m.node
        while node is not None and node.parent is not None:  # up to its root (an old one if stale)
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.stale:  # invalidated: the tree's references go now
                    self.allocator.free(node.pages)
                else:
                    self._locked_pages -= len(node.pages)
            node = node.parent

    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """Cache `pages`, which hold the KV of `token_ids` (whole pages), taking over the caller's one
        reference on each: a page whose tokens are new to the tree stays as the tree's, one whose
        tokens are already cached is freed (the tree keeps its own copy). Returns the pages added."""
        ps = self.page_size
        if len(token_ids) != len(pages) * ps:
            raise ValueError(f"{len(token_ids)} token ids for {len(pages)} pages of {ps} tokens")
        key = tuple(token_ids)
        node, i, j = self.root, 0, 0  # i: token index, j: page index
        now = next(self._tick)
        while j < len(pages):
            child = node.children.get(key[i : i + ps])
            if child is None:
                parent_hash = node.hashes[-1] if node.hashes else ROOT_HASH
                hashes = block_hashes(key[i:], ps, parent_hash)
                new = _Node(key[i:], list(pages[j:]), node, hashes, last_access=now)
                if self.record_events:
                    self._stored += hashes
                node.children[key[i : i + ps]] = new
                self.num_pages += len(new.pages)
                return len(new.pages)
            n = self._common_pages(child, key, i)
            if n < len(child.pages):
                child = self._split(child, n).parent
                assert child is not None
            child.last_access = now
            self.allocator.free(pages[j : j + n])  # duplicates of cached pages (or the cached ones)
            i, j, node = i + n * ps, j + n, child
        return 0

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` tree pages, least recently used leaves first, taking a leaf's pages
        from its end. Locked nodes are never touched. Returns the pages freed."""
        ps = self.page_size
        heap: list[tuple[int, int, _Node]] = [
            (n.last_access, id(n), n) for n in self._nodes() if not n.children and not n.lock_ref
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            k = min(num_pages - freed, len(leaf.pages))
            first = leaf.key[:ps]
            drop = leaf.pages[len(leaf.pages) - k :]
            leaf.pages = leaf.pages[: len(leaf.pages) - k]
            leaf.key = leaf.key[: len(leaf.pages) * ps]
            if self.record_events:
                self._removed += leaf.hashes[len(leaf.pages) :]
            leaf.hashes = leaf.hashes[: len(leaf.pages)]
            self.allocator.free(drop)  # the tree's references: back to the free list
            self.num_pages -= k
            freed += k
            if not leaf.pages:
                parent = leaf.parent
                assert parent is not None
                del parent.children[first]
                if parent is not self.root and not parent.children and not parent.lock_ref:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> None:
        """Empty the tree; only when no match holds a lock."""
        if self._held:
            raise RuntimeError(f"cannot flush the prefix cache: {sum(self._held.values())} matches hold it")
        for n in self._nodes():
            self.allocator.free(n.pages)
            if self.record_events:
                self._removed += n.hashes
        self.root = _Node((), [], None)
        self.num_pages = 0

    def invalidate(self) -> None:
        """Forget every cached page at once, locked or not (the weights changed: their KV is another
        model's). Unlocked pages are freed now; locked ones leave the tree too (no later match finds
        them) and are freed when the last match holding them is released."""
        for n in self._nodes():
            if self.record_events:
                self._removed += n.hashes
            if n.lock_ref:
                n.stale = True
            else:
                self.allocator.free(n.pages)
        self.root.stale = True  # matches of no tokens end at it
        self.root = _Node((), [], None)
        self.num_pages = self._locked_pages = 0

    def _common_pages(self, child: _Node, key: Key, i: int) -> int:
        """How many of `child`'s pages hold the same tokens as `key` from index `i` on."""
        ps = self.page_size
        n = 0
        while n < len(child.pages) and i + (n + 1) * ps <= len(key):
            if child.key[n * ps : (n + 1) * ps] != key[i + n * ps : i + (n + 1) * ps]:
                break
            n += 1
        return n

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node` after its first `n` pages: a new parent takes them, `node` keeps the rest (and its
        identity, so matches that end at it still do). Returns `node`."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.pages)
        head = _Node(node.key[: n * ps], node.pages[:n], parent, node.hashes[:n], lock_ref=node.lock_ref)
        head.last_access = node.last_access
        parent.children[head.key[:ps]] = head
        node.key, node.pages, node.parent = node.key[n * ps :], node.pages[n:], head
        node.hashes = node.hashes[n:]
        head.children[node.key[:ps]] = node
        return node

    def _lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def _nodes(self) -> list[_Node]:
        """Every node but the root."""
        out: list[_Node] = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check_invariants(self) -> None:
        """Tree shape, lock counts and page references agree; tests call this after every step."""
        self.allocator.check_invariants()
        ps = self.page_size
        alloc = self.allocator
        seen: set[int] = set()
        locked = 0
        for n in self._nodes():
            if not n.pages or len(n.key) != len(n.pages) * ps:
                raise AssertionError(f"node with {len(n.key)} token ids and {len(n.pages)} pages")
            assert n.parent is not None
            if n.parent.children.get(n.key[:ps]) is not n:
                raise AssertionError("a node is not under its first page in its parent")
            parent_hash = n.parent.hashes[-1] if n.parent.hashes else ROOT_HASH
            if n.hashes != block_hashes(n.key, ps, parent_hash):
                raise AssertionError("a node's block hashes do not chain from its parent's")
            expect = self._held[n] + sum(c.lock_ref for c in n.children.values())
            if n.lock_ref != expect:
                raise AssertionError(f"lock_ref {n.lock_ref}, but {expect} matches run through the node")
            locked += len(n.pages) if n.lock_ref else 0
            for p in n.pages:
                if p in seen:
                    raise AssertionError(f"page {p} is in the tree twice")
                seen.add(p)
                # The tree's reference plus one per lock: a leaked or missing reference shows here.
                if alloc.refcount(p) != 1 + n.lock_ref:
                    raise AssertionError(
                        f"tree page {p}: refcount {alloc.refcount(p)}, lock_ref {n.lock_ref}"
                    )
        if len(seen) != self.num_pages or locked != self._locked_pages:
            raise AssertionError(
                f"counters: {self.num_pages} pages / {self._locked_pages} locked, "
                f"tree has {len(seen)} / {locked}"
            )
        in_use = sum(1 for p in range(alloc.num_pages) if alloc.refcount(p) > 0 and p not in seen)
        if alloc.num_free + len(seen) + in_use != alloc.num_pages:
            raise AssertionError("free + tree + in-use pages != total pages")
        nodes = set(self._nodes())
        if any(n is not self.root and not n.stale and n not in nodes for n in self._held):
            raise AssertionError("a held match ends at a node that left the tree")
