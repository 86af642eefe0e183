"""Admission and chunked prefill: which prompt chunks run in the next extend forward.

Shared by the offline engine (which reserves a request's whole lifetime at admission) and the
prefill worker (which reserves only the prompt; the decode node holds the rest). It owns the pages
of the requests it admitted until they leave through `retire` (finished or failed), and tracks
their deadlines until then (`expire`), handed-off ones included.

With a prefix cache, admission starts a request on its longest cached prefix (`Request.num_computed`
and `cached_tokens` set, those pages shared and locked), evicting unlocked cached pages when the pool
is short; `retire` leaves the request's computed whole prompt pages in the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pdserve.runtime.deadlines import Deadlines
from pdserve.runtime.kv_pool import RequestPages
from pdserve.runtime.radix_cache import PrefixMatch, RadixCache
from pdserve.runtime.request import Request, RequestState


class ExtendScheduler:
    def __init__(
        self,
        pages: RequestPages,
        token_budget: int,
        max_requests: int,
        reserve_tokens: Callable[[Request], int],
        cache: RadixCache | None = None,
    ):
        self.pages = pages
        self.token_budget = token_budget
        self.max_requests = max_requests
        self.reserve_tokens = reserve_tokens
        self.waiting: deque[Request] = deque()  # QUEUED
        self.prefilling: list[Request] = []  # PREFILLING
        self.deadlines = Deadlines()  # every request added and not yet retired
        self.cache = cache
        self.matches: dict[str, PrefixMatch] = {}  # room -> its cached prefix, locked until `retire`

    @property
    def free_tokens(self) -> int:
        """Tokens admission can still allocate: free pages plus cached pages it may evict."""
        evictable = self.cache.evictable_pages if self.cache else 0
        return self.pages.free_tokens + evictable * self.pages.page_size

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefilling)

    def add(self, req: Request, deadline: float | None = None) -> None:
        """Queue `req`; `deadline` (epoch seconds, see `runtime/deadlines.py`) ends it in `expire`."""
        if req.state is not RequestState.QUEUED:
            raise ValueError(f"request {req.room} is {req.state.name}, not QUEUED")
        self.deadlines.add(req, deadline)
        self.waiting.append(req)

    def expire(self, now: float) -> list[Request]:
        """Requests past their deadline at `now`. Queued and prefilling ones fail here (pages freed);
        transferring ones are returned still TRANSFERRING, pages held: the caller stops their transfer
        and calls `retire` when it ends, as for an abort."""
        due = self.deadlines.due(now)
        for r in due:
            if r.state in (RequestState.QUEUED, RequestState.PREFILLING):
                self.retire(r, RequestState.FAILED)
        return due

    def schedule(self, occupied: int = 0) -> tuple[list[Request], list[list[int]]]:
        """Prompt chunks within the token budget: unfinished prompts first, then new admissions.

        `occupied` counts requests held elsewhere (the engine's running batch) against max_requests.
        A request is admitted only when its reservation fits, so admitted work never stalls on pages.
        """
        budget = self.token_budget
        reqs: list[Request] = []
        chunks: list[list[int]] = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, len(r.prompt_ids) - r.num_computed)
            reqs.append(r)
            chunks.append(r.prompt_ids[r.num_computed : r.num_computed + n])
            budget -= n
        while self.waiting and budget > 0 and occupied + len(self.prefilling) < self.max_requests:
            r = self.waiting[0]
            if not self._reserve(r):
                break
            self.waiting.popleft()
            r.transition(RequestState.PREFILLING)
            self.prefilling.append(r)
            n = min(budget, len(r.prompt_ids) - r.num_computed)
            reqs.append(r)
            chunks.append(r.prompt_ids[r.num_computed : r.num_computed + n])
            budget -= n
        return reqs, chunks

    def _reserve(self, r: Request) -> bool:
        """Pages for `r`'s reservation on top of its cached prefix; on failure nothing is held."""
        if self.cache is None or not r.kv_cacheable:
            return self.pages.reserve(r, self.reserve_tokens(r))
        # Matched before evicting, so the eviction cannot take the prefix this request is about to use.
        # Prompt logprobs from position s need logits from position s - 1 on: only a prefix before it
        # may come from the cache.
        start = r.params.logprob_start_len
        m = self.cache.match(r.prompt_ids if start < 0 else r.prompt_ids[:start])
        r.pages, r.num_computed, r.cached_tokens = list(m.pages), m.num_tokens, m.num_tokens
        short = self.pages.pages_for(self.reserve_tokens(r)) - len(r.pages) - self.pages.allocator.num_free
        if 0 < short <= self.cache.evictable_pages:  # evict only when that admits the request
            self.cache.evict(short)
        if not self.pages.reserve(r, self.reserve_tokens(r)):
            self.cache.release(m)
            self.pages.release(r)
            r.num_computed = r.cached_tokens = 0
            return False
        self.matches[r.room] = m
        return True

    def take_completed(self, reqs: list[Request]) -> tuple[list[Request], list[int]]:
        """After a forward: the requests whose whole prompt is now computed, and their logits rows.

        They leave the prefilling set still PREFILLING, pages held: the caller samples their first
        token and moves them on (`hand_off`, or the engine's running batch)."""
        done, rows = [], []
        for i, r in enumerate(reqs):
            if r.num_computed == len(r.prompt_ids):
                done.append(r)
                rows.append(i)
                self.prefilling.remove(r)
        return done, rows

    def hand_off(self, req: Request) -> None:
        """A completed prefill whose KV now goes to a decode node; its pages stay held until `retire`."""
        req.transition(RequestState.TRANSFERRING)

    def retire(self, req: Request, state: RequestState) -> None:
        """The request leaves for good as `state` (FINISHED or FAILED, e.g. an abort): it is dropped
        from whichever set holds it and its pages are freed."""
        if state not in (RequestState.FINISHED, RequestState.FAILED):
            raise ValueError(f"retire into {state.name}: only FINISHED or FAILED")
        req.transition(state)
        self.deadlines.discard(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if self.cache is not None:
            m = self.matches.pop(req.room, None)
            if m is not None:
                self.cache.release(m)
            # Whole prompt pages whose KV was computed (all of them once prefilled) stay cached; the
            # cache takes over their references, and the rest (partial page, output tokens) is freed.
            n = min(req.num_computed, len(req.prompt_ids)) // self.pages.page_size if req.kv_cacheable else 0
            self.cache.insert(req.prompt_ids[: n * self.pages.page_size], req.pages[:n])
            req.pages = req.pages[n:]
        self.pages.release(req)
