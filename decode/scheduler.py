"""The decode node's request sets and its page policy: admission, growth, retraction, resumption.

Sets (a request is in exactly one, and its state says which): pending (QUEUED, no pages yet) ->
transferring (TRANSFERRING: pages held, KV on its way) -> running (RUNNING: decoding); running ->
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
"""

from __future__ import annotations

import logging
from collections import deque

from pdserve.runtime.deadlines import Deadlines
from pdserve.runtime.kv_pool import RequestPages
from pdserve.runtime.request import Request, RequestState

log = logging.getLogger(__name__)

# Tokens beyond the prompt reserved at admission: a few steps of decoding before the first growth.
ADMISSION_HEADROOM = 32


class DecodeScheduler:
    def __init__(self, pages: RequestPages, max_running: int, lookahead: int):
        self.pages = pages
        self.max_running = max_running
        # Tokens one step may append per request (1, or 1 + drafts when speculating).
        self.lookahead = lookahead
        self.pending: deque[Request] = deque()
        self.transferring: dict[str, Request] = {}
        self.running: list[Request] = []
        self.retracted: deque[Request] = deque()
        self.deadlines = Deadlines()  # every request added and not yet gone

    def __len__(self) -> int:
        return len(self.pending) + len(self.transferring) + len(self.running) + len(self.retracted)

    def add(self, r: Request, deadline: float | None = None) -> None:
        """Queue `r`; `deadline` (epoch seconds, see `runtime/deadlines.py`) ends it in `expire`."""
        if r.state is not RequestState.QUEUED:
            raise ValueError(f"request {r.rid} is {r.state.name}, not QUEUED")
        self.deadlines.add(r, deadline)
        self.pending.append(r)

    def expire(self, now: float) -> list[Request]:
        """Requests past their deadline at `now`. Pending, running and retracted ones fail here
        (pages freed); transferring ones are returned still TRANSFERRING: the caller aborts their
        transfer and calls `kv_failed` when the receiver reports Failed, as for an abort."""
        due = self.deadlines.due(now)
        for r in due:
            if r.state is not RequestState.TRANSFERRING:
                self.remove(r.rid)
        return due

    def is_transferring(self, rid: str) -> bool:
        return rid in self.transferring

    def _initial_tokens(self, r: Request) -> int:
        return min(r.max_total_tokens, r.num_tokens + ADMISSION_HEADROOM)

    def _has_slot(self) -> bool:
        return len(self.running) + len(self.transferring) < self.max_running

    def resume_retracted(self) -> list[Request]:
        """Retracted requests whose pages fit again (oldest first) rejoin running.

        Their pages hold no KV yet: the caller recomputes it (`ModelRunner.recompute`) before the
        next decode step."""
        resumed = []
        while self.retracted and self._has_slot():
            r = self.retracted[0]
            if not self.pages.reserve(r, self._initial_tokens(r)):
                break
            self.retracted.popleft()
            r.transition(RequestState.RUNNING)
            self.running.append(r)
            resumed.append(r)
        return resumed

    def admit(self) -> list[Request]:
        """Pending requests that got pages; the caller asks their prefill nodes for the KV.

        Retracted requests go first: admitting new work while older work waits would starve it.
        """
        admitted = []
        while self.pending and not self.retracted and self._has_slot():
            r = self.pending[0]
            if not self.pages.reserve(r, max(len(r.prompt_ids), self._initial_tokens(r))):
                break
            self.pending.popleft()
            r.transition(RequestState.TRANSFERRING)
            self.transferring[r.rid] = r
            admitted.append(r)
        return admitted

    def grow_or_retract(self) -> list[Request]:
        """Give every running request pages for this step's tokens, retracting the newest if short."""
        retracted = []
        i = 0
        while i < len(self.running):
            r = self.running[i]
            need = min(r.max_total_tokens, r.num_tokens + self.lookahead)
            if self.pages.reserve(r, need):
                i += 1
                continue
            # Even the oldest is retracted when nothing younger is left: pages held by transfers come
            # back when those finish, and then it resumes.
            victim = self.running[-1]
            self.retract(victim)
            retracted.append(victim)
        return retracted

    def kv_arrived(self, rid: str) -> Request | None:
        """A transfer succeeded: the request's prompt KV is in its pages and it joins running (the
        caller appends the first token the prefill node sampled). None when the room is not here."""
        r = self.transferring.pop(rid, None)
        if r is None:
            return None
        r.num_computed = len(r.prompt_ids)
        r.transition(RequestState.RUNNING)
        self.running.append(r)
        return r

    def kv_failed(self, rid: str) -> Request | None:
        """A transfer failed (or was aborted): the request fails and its pages are freed."""
        r = self.transferring.pop(rid, None)
        if r is not None:
            self._drop(r)
        return r

    def retract(self, r: Request) -> None:
        """Take a running request out of the batch: pages freed, outputs kept, resumed later."""
        r.transition(RequestState.RETRACTED)
        self.running.remove(r)
        self.pages.release(r)
        r.num_computed = 0
        r.num_retractions += 1
        # Victims go newest first, so pushing each to the front keeps the queue oldest-first.
        self.retracted.appendleft(r)
        log.info("retracted %s (%d tokens) under KV pool pressure", r.rid, r.num_tokens)

    def retire_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        for r in done:
            self.running.remove(r)
            r.transition(RequestState.FINISHED)
            self.deadlines.discard(r)
            self.pages.release(r)
        return done

    def remove(self, rid: str) -> Request | None:
        """Drop a request from whichever set holds it (abort); it fails and its pages are freed.
        Transferring ones are left to the receiver: the caller aborts the transfer and calls
        `kv_failed` when it reports Failed."""
        for q in (self.pending, self.retracted, self.running):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    self._drop(r)
                    return r
        return None

    def _drop(self, r: Request) -> None:
        r.transition(RequestState.FAILED)
        self.deadlines.discard(r)
        self.pages.release(r)
