"""Request deadlines on the schedulers, no model: an allocator, requests, and the clock passed in.

A request past its deadline leaves whatever state it is in and its pages come back; a transferring
one is handed to the caller still holding its pages (the transfer has to be stopped first)."""

from __future__ import annotations

import pytest

from pdserve.decode.scheduler import DecodeScheduler
from pdserve.runtime.deadlines import Deadlines
from pdserve.runtime.extend_scheduler import ExtendScheduler
from pdserve.runtime.kv_pool import PageAllocator, RequestPages
from pdserve.runtime.request import Request, RequestState
from pdserve.sampling_params import SamplingParams

PAGE = 4
NUM_PAGES = 64


def req(i: int, prompt_len: int = 8) -> Request:
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=8, ignore_eos=True))


def test_deadlines_due_only_once_and_oldest_first():
    d = Deadlines()
    a, b, c = req(0), req(1), req(2)
    d.add(a, 20.0)
    d.add(b, 10.0)
    d.add(c, None)  # no deadline: never due
    assert d.due(9.9) == []
    assert d.due(25.0) == [b, a]
    assert d.due(1e9) == [] and len(d) == 0
    d.add(a, 5.0)
    d.discard(a)
    assert d.due(6.0) == []
    with pytest.raises(ValueError, match="finite"):
        d.add(a, float("nan"))


def test_prefill_scheduler_expires_queued_prefilling_and_hands_back_transferring():
    pages = RequestPages(PageAllocator(NUM_PAGES), PAGE)
    s = ExtendScheduler(pages, token_budget=12, max_requests=8, reserve_tokens=lambda r: len(r.prompt_ids))
    moving, half, queued, late = req(0, 4), req(1, 16), req(2, 8), req(3, 4)
    for r in (moving, half, queued):
        s.add(r, deadline=100.0)
    s.add(late, deadline=200.0)
    reqs, chunks = s.schedule()  # budget 12: all of `moving`, 8 tokens of `half`
    assert reqs == [moving, half]
    for r, c in zip(reqs, chunks):
        r.num_computed += len(c)
    done, _ = s.take_completed(reqs)
    assert done == [moving]
    s.hand_off(moving)
    assert (half.state, queued.state) == (RequestState.PREFILLING, RequestState.QUEUED)

    assert s.expire(99.0) == []
    due = s.expire(100.0)
    assert sorted(r.room for r in due) == ["r0", "r1", "r2"]
    assert half.state is RequestState.FAILED and queued.state is RequestState.FAILED
    assert half.pages == [] and len(s) == 1  # only `late` is left to schedule
    # The transferring one keeps its pages until the caller has stopped its transfer.
    assert moving.state is RequestState.TRANSFERRING and moving.pages
    s.retire(moving, RequestState.FAILED)
    assert s.expire(150.0) == []
    assert s.expire(200.0) == [late] and late.state is RequestState.FAILED
    assert pages.allocator.num_free == NUM_PAGES
    pages.allocator.check_invariants()


def test_decode_scheduler_expires_every_state():
    pages = RequestPages(PageAllocator(NUM_PAGES), PAGE)
    s = DecodeScheduler(pages, max_running=8, lookahead=1)
    running, retracted, moving, pending, finished = (req(i) for i in range(5))
    for r in (running, retracted, moving, finished):
        s.add(r, deadline=50.0)
    assert s.admit() == [running, retracted, moving, finished]
    for r in (running, retracted, finished):
        assert s.kv_arrived(r.room) is r
        r.append_token(7)
    s.retract(retracted)
    s.add(pending, deadline=50.0)
    s.max_running = 0  # `pending` stays pending
    for _ in range(7):  # to max_new_tokens
        finished.append_token(7)
    assert s.retire_finished() == [finished]
    states = {r.room: r.state for r in (running, retracted, moving, pending)}
    assert set(states.values()) == {
        RequestState.RUNNING,
        RequestState.RETRACTED,
        RequestState.TRANSFERRING,
        RequestState.QUEUED,
    }

    due = s.expire(50.0)
    assert {r.room for r in due} == {"r0", "r1", "r2", "r3"}, "a finished request is not expired"
    for r in (running, retracted, pending):
        assert r.state is RequestState.FAILED and r.pages == []
    assert moving.state is RequestState.TRANSFERRING and s.is_transferring(moving.room)
    assert s.kv_failed(moving.room) is moving  # what the worker does once the receiver reports
    assert len(s) == 0 and pages.allocator.num_free == NUM_PAGES
    pages.allocator.check_invariants()
