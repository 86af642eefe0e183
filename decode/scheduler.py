"""The decode node's request sets and its page policy: admission, growth, retraction, resumption.

Sets (a request is in exactly one): pending (no pages yet) -> transferring (pages held, KV on its
way) -> running (decoding); running -> retracted (pages freed under pool pressure) -> running again
after its KV is recomputed here; any -> gone (finished, aborted, failed).

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

from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner

log = logging.getLogger(__name__)

# Tokens beyond the prompt reserved at admission: a few steps of decoding before the first growth.
ADMISSION_HEADROOM = 32


class DecodeScheduler:
    def __init__(self, runner: ModelRunner, max_running: int, lookahead: int):
        self.runner = runner
        self.max_running = max_running
        # Tokens one step may append per request (1, or 1 + drafts when speculating).
        self.lookahead = lookahead
        self.pending: deque[Request] = deque()
        self.transferring: dict[str, Request] = {}
        self.running: list[Request] = []
        self.retracted: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.pending) + len(self.transferring) + len(self.running) + len(self.retracted)

    def _initial_tokens(self, r: Request) -> int:
        return min(r.max_total_tokens, r.num_tokens + ADMISSION_HEADROOM)

    def _has_slot(self) -> bool:
        return len(self.running) + len(self.transferring) < self.max_running

    def resume_retracted(self) -> list[Request]:
        """Recompute the KV of retracted requests that fit again (oldest first); they rejoin running."""
        resumed = []
        while self.retracted and self._has_slot():
            r = self.retracted[0]
            if not self.runner.reserve(r, self._initial_tokens(r)):
                break
            self.retracted.popleft()
            tokens = (r.prompt_ids + r.output_ids)[:-1]  # the newest token is fed by the next step
            r.num_computed = 0
            self.runner.forward(ForwardMode.EXTEND, [r], [tokens])
            r.state = RequestState.RUNNING
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
            if not self.runner.reserve(r, max(len(r.prompt_ids), self._initial_tokens(r))):
                break
            self.pending.popleft()
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
            if self.runner.reserve(r, need):
                i += 1
                continue
            # Even the oldest is retracted when nothing younger is left: pages held by transfers come
            # back when those finish, and then it resumes.
            victim = self.running.pop()
            self.retract(victim)
            retracted.append(victim)
        return retracted

    def retract(self, r: Request) -> None:
        self.runner.release(r)
        r.num_computed = 0
        r.num_retractions += 1
        r.state = RequestState.WAITING
        # Victims go newest first, so pushing each to the front keeps the queue oldest-first.
        self.retracted.appendleft(r)
        log.info("retracted %s (%d tokens) under KV pool pressure", r.rid, r.num_tokens)

    def retire_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        for r in done:
            self.running.remove(r)
            r.state = RequestState.FINISHED
            self.runner.release(r)
        return done

    def remove(self, rid: str) -> Request | None:
        """Drop a request from whichever set holds it (abort). Transferring ones are left to the
        receiver: the caller aborts the transfer and frees the pages when it reports Failed."""
        for q in (self.pending, self.retracted):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    self.runner.release(r)
                    return r
        for r in self.running:
            if r.rid == rid:
                self.running.remove(r)
                self.runner.release(r)
                return r
        return None
