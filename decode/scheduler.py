"""The decode node's request sets and its page policy: admission, growth, retraction, resumption.

Sets (a request is in exactly one, and its state says which): pending (QUEUED, no pages yet) ->
transferring (TRANSFERRING: pages held, KV on its way) -> running (RUNNING: decoding), or for a
local prefill (no prefill node involved) pending -> prefilling (PREFILLING: the caller computes the
prompt in this step) -> running; running ->
retracted (RETRACTED: pages freed under pool pressure) -> running again once its pages are back and
the caller has recomputed its KV; any -> gone (FINISHED, or FAILED: aborted or a failed transfer).
Only this class moves requests between the sets, and it allocates and frees their pages; it runs
no forward, so it needs no model. It also tracks each request's deadline until it leaves (`expire`).

Page policy: admission reserves the prompt plus a small headroom, not the whole lifetime, so more
requests fit; before each step every running request grows to cover the tokens the step may write.
When the pool cannot cover that, the newest running requests are retracted (pages freed, outputs
kept) and resumed later by recomputing their KV. The oldest request never waits on a younger one,
so the batch always makes progress (a single request always fits: admission checked its lifetime
against the pool).

Prefix cache (`cache`, unless --disable-radix-cache): admission starts a request on the longest
prefix of its prompt this node holds (pages shared and locked; `Request.cached_tokens`), so only the
pages after it travel (incremental transfer: `skip_pages`, `prefix_hash`) or are computed (local
prefill). A finished request leaves the whole pages of its prompt and output whose KV is written in
the cache: the next turn of a conversation finds its history here. Cached pages that no request
holds are evicted (least recently used) before a running request is retracted.
"""

from __future__ import annotations

import logging
from collections import deque

from pdserve.runtime.deadlines import Deadlines
from pdserve.runtime.kv_pool import RequestPages
from pdserve.runtime.radix_cache import PrefixMatch, RadixCache
from pdserve.runtime.request import Request, RequestState

log = logging.getLogger(__name__)

# Tokens beyond the prompt reserved at admission: a few steps of decoding before the first growth.
ADMISSION_HEADROOM = 32


class DecodeScheduler:
    def __init__(
        self, pages: RequestPages, max_running: int, lookahead: int, cache: RadixCache | None = None
    ):
        self.pages = pages
        self.cache = cache
        self.matches: dict[str, PrefixMatch] = {}  # room -> its cached prefix, locked while it lives
        self.local: set[str] = set()  # rooms whose prompt this node computes (local prefill)
        self.no_cache: set[str] = set()  # rooms whose cached prefix the prefill node refused
        self.max_running = max_running
        # Tokens one step may append per request (1, or 1 + drafts when speculating).
        self.lookahead = lookahead
        self.pending: deque[Request] = deque()
        self.transferring: dict[str, Request] = {}
        self.prefilling: list[Request] = []  # admitted local prefills, computed in this step
        self.running: list[Request] = []
        self.retracted: deque[Request] = deque()
        self.deadlines = Deadlines()  # every request added and not yet gone

    def __len__(self) -> int:
        n = len(self.pending) + len(self.transferring) + len(self.prefilling)
        return n + len(self.running) + len(self.retracted)

    @property
    def free_tokens(self) -> int:
        """Tokens admission can still allocate: free pages plus cached pages it may evict."""
        evictable = self.cache.evictable_pages if self.cache else 0
        return (self.pages.allocator.num_free + evictable) * self.pages.page_size

    def add(self, r: Request, deadline: float | None = None, local_prefill: bool = False) -> None:
        """Queue `r`; `deadline` (epoch seconds, see `runtime/deadlines.py`) ends it in `expire`.
        `local_prefill`: this node computes the prompt (no transfer; `admit` returns it PREFILLING)."""
        if r.state is not RequestState.QUEUED:
            raise ValueError(f"request {r.room} is {r.state.name}, not QUEUED")
        self.deadlines.add(r, deadline)
        if local_prefill:
            self.local.add(r.room)
        self.pending.append(r)

    def expire(self, now: float) -> list[Request]:
        """Requests past their deadline at `now`. Pending, running and retracted ones fail here
        (pages freed); transferring ones are returned still TRANSFERRING: the caller aborts their
        transfer and calls `kv_failed` when the receiver reports Failed, as for an abort."""
        due = self.deadlines.due(now)
        for r in due:
            if r.state is not RequestState.TRANSFERRING:
                self.remove(r.room)
        return due

    def is_transferring(self, room: str) -> bool:
        return room in self.transferring

    def _initial_tokens(self, r: Request) -> int:
        return min(r.max_total_tokens, r.num_tokens + ADMISSION_HEADROOM)

    def _has_slot(self) -> bool:
        return len(self.running) + len(self.transferring) + len(self.prefilling) < self.max_running

    def _reserve(self, r: Request, num_tokens: int) -> bool:
        """Grow `r`'s pages to `num_tokens`, evicting unheld cached pages when that is enough."""
        if self.pages.reserve(r, num_tokens):
            return True
        if self.cache is None:
            return False
        short = self.pages.pages_for(num_tokens) - len(r.pages) - self.pages.allocator.num_free
        if short > self.cache.evictable_pages:
            return False
        self.cache.evict(short)
        return self.pages.reserve(r, num_tokens)

    def _admit_pages(self, r: Request) -> bool:
        """Pages for a new request, on top of its cached prefix; on failure nothing is held."""
        want = max(len(r.prompt_ids), self._initial_tokens(r))
        if self.cache is None or r.room in self.no_cache or not r.kv_cacheable:
            return self._reserve(r, want)
        m = self.cache.match(r.prompt_ids)
        r.pages, r.cached_tokens = list(m.pages), m.num_tokens
        if self._reserve(r, want):
            self.matches[r.room] = m
            return True
        self.cache.release(m)
        self.pages.release(r)  # the match's page references
        r.cached_tokens = 0
        return False

    def skip(self, r: Request) -> tuple[int, int | None]:
        """(pages the transfer skips, block hash of the last): the cached prefix of an admitted request."""
        m = self.matches.get(r.room)
        if m is None or not m.pages:
            return 0, None
        return len(m.pages), m.last_hash

    def _unmatch(self, r: Request) -> None:
        """Drop the lock of `r`'s cached prefix (its page references go with `r.pages`)."""
        m = self.matches.pop(r.room, None)
        if m is not None and self.cache is not None:
            self.cache.release(m)

    def resume_retracted(self) -> list[Request]:
        """Retracted requests whose pages fit again (oldest first) rejoin running.

        Their pages hold no KV yet: the caller recomputes it (`ModelRunner.recompute`) before the
        next decode step."""
        resumed = []
        while self.retracted and self._has_slot():
            r = self.retracted[0]
            if not self._reserve(r, self._initial_tokens(r)):
                break
            self.retracted.popleft()
            r.transition(RequestState.RUNNING)
            self.running.append(r)
            resumed.append(r)
        return resumed

    def admit(self) -> list[Request]:
        """Pending requests that got pages: TRANSFERRING ones (the caller asks their prefill nodes
        for the KV after `skip`) and PREFILLING ones (local prefills: the caller computes the prompt
        from `num_computed` on, samples the first token and calls `prefilled`).

        Retracted requests go first: admitting new work while older work waits would starve it.
        """
        admitted = []
        while self.pending and not self.retracted and self._has_slot():
            r = self.pending[0]
            if not self._admit_pages(r):
                break
            self.pending.popleft()
            if r.room in self.local:
                r.num_computed = r.cached_tokens
                r.transition(RequestState.PREFILLING)
                self.prefilling.append(r)
            else:
                r.transition(RequestState.TRANSFERRING)
                self.transferring[r.room] = r
            admitted.append(r)
        return admitted

    def prefilled(self, r: Request) -> None:
        """A local prefill computed its prompt and sampled its first token: it joins running."""
        self.prefilling.remove(r)
        self.local.discard(r.room)
        r.transition(RequestState.RUNNING)
        self.running.append(r)

    def prefix_refused(self, room: str) -> Request | None:
        """The prefill node refused the cached prefix of a transfer: the request goes back to the
        front of pending, its pages freed, to be admitted again without the cache (a full transfer)."""
        r = self.transferring.pop(room, None)
        if r is None:
            return None
        self._unmatch(r)
        self.pages.release(r)
        r.cached_tokens = 0
        self.no_cache.add(room)
        r.transition(RequestState.QUEUED)
        self.pending.appendleft(r)
        return r

    def grow_or_retract(self) -> list[Request]:
        """Give every running request pages for this step's tokens, retracting the newest if short."""
        retracted = []
        i = 0
        while i < len(self.running):
            r = self.running[i]
            need = min(r.max_total_tokens, r.num_tokens + self.lookahead)
            if self._reserve(r, need):
                i += 1
                continue
            # Even the oldest is retracted when nothing younger is left: pages held by transfers come
            # back when those finish, and then it resumes.
            victim = self.running[-1]
            self.retract(victim)
            retracted.append(victim)
        return retracted

    def kv_arrived(self, room: str) -> Request | None:
        """A transfer succeeded: the request's prompt KV is in its pages and it joins running (the
        caller appends the first token the prefill node sampled). None when the room is not here."""
        r = self.transferring.pop(room, None)
        if r is None:
            return None
        r.num_computed = len(r.prompt_ids)
        r.transition(RequestState.RUNNING)
        self.running.append(r)
        return r

    def kv_failed(self, room: str) -> Request | None:
        """A transfer failed (or was aborted): the request fails and its pages are freed."""
        r = self.transferring.pop(room, None)
        if r is not None:
            self._drop(r)
        return r

    def retract(self, r: Request) -> None:
        """Take a running request out of the batch: pages freed, outputs kept, resumed later."""
        r.transition(RequestState.RETRACTED)
        self.running.remove(r)
        self._unmatch(r)
        self.pages.release(r)
        r.num_computed = 0
        r.num_retractions += 1
        # Victims go newest first, so pushing each to the front keeps the queue oldest-first.
        self.retracted.appendleft(r)
        log.info("retracted %s (%d tokens) under KV pool pressure", r.room, r.num_tokens)

    def retire_finished(self) -> list[Request]:
        """Finished requests leave; with a cache, the whole pages of their prompt and output whose
        KV is written (every token but the newest) stay cached, the rest is freed."""
        done = [r for r in self.running if r.finished]
        for r in done:
            self.running.remove(r)
            r.transition(RequestState.FINISHED)
            self.deadlines.discard(r)
            self._cache_pages(r)
            self.pages.release(r)
        return done

    def _cache_pages(self, r: Request) -> None:
        self._unmatch(r)
        self.no_cache.discard(r.room)
        if self.cache is None or not r.kv_cacheable:
            return
        ps = self.pages.page_size
        n = min(r.num_computed, r.num_tokens - 1, len(r.pages) * ps) // ps
        self.cache.insert((r.prompt_ids + r.output_ids)[: n * ps], r.pages[:n])
        r.pages = r.pages[n:]

    def live(self) -> list[Request]:
        """Every request this node holds, in any set."""
        sets = (self.pending, self.transferring.values(), self.prefilling, self.running, self.retracted)
        return [r for s in sets for r in s]

    def remove(self, room: str) -> Request | None:
        """Drop a request from whichever set holds it (abort); it fails and its pages are freed.
        Transferring ones are left to the receiver: the caller aborts the transfer and calls
        `kv_failed` when it reports Failed."""
        for q in (self.pending, self.retracted, self.running, self.prefilling):
            for r in q:
                if r.room == room:
                    q.remove(r)
                    self._drop(r)
                    return r
        return None

    def _drop(self, r: Request) -> None:
        r.transition(RequestState.FAILED)
        self.deadlines.discard(r)
        self._unmatch(r)
        self.local.discard(r.room)
        self.no_cache.discard(r.room)
        self.pages.release(r)
