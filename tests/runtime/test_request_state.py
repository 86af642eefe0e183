"""A request's state machine: every legal path of each node walks through, anything else raises."""

from __future__ import annotations

import pytest

from pdserve.runtime.request import Request
from pdserve.runtime.request_state import IllegalTransition, RequestState
from pdserve.sampling_params import SamplingParams

Q, P, T, R, X = (
    RequestState.QUEUED,
    RequestState.PREFILLING,
    RequestState.TRANSFERRING,
    RequestState.RUNNING,
    RequestState.RETRACTED,
)
DONE, FAILED = RequestState.FINISHED, RequestState.FAILED

LEGAL_PATHS = {
    "offline, first token ends it": [P, DONE],
    "offline": [P, R, DONE],
    "prefill node": [P, T, DONE],
    "decode node": [T, R, DONE],
    "decode node, retracted twice": [T, R, X, R, X, R, DONE],
    "decode node, KV computed locally": [R, X, R, DONE],
}
LIVE = [Q, P, T, R, X]


def new_request() -> Request:
    return Request("r0", [1, 2, 3], SamplingParams(max_new_tokens=4))


def walk(r: Request, path: list[RequestState]) -> None:
    for s in path:
        r.transition(s)
        assert r.state is s


@pytest.mark.parametrize("path", LEGAL_PATHS.values(), ids=LEGAL_PATHS.keys())
def test_legal_paths(path):
    r = new_request()
    assert r.state is Q
    walk(r, path)


# A path that reaches each live state, so failing from it can be tried.
REACH = {Q: [], P: [P], T: [P, T], R: [T, R], X: [T, R, X]}


@pytest.mark.parametrize("live", LIVE, ids=[s.name for s in LIVE])
def test_every_live_state_can_fail_and_failed_is_terminal(live):
    r = new_request()
    walk(r, REACH[live] + [FAILED])
    for s in RequestState:
        with pytest.raises(IllegalTransition):
            r.transition(s)
    assert r.state is FAILED


@pytest.mark.parametrize(
    "path, bad",
    [
        ([], DONE),  # a queued request has produced nothing to finish with
        ([], X),  # only a running request can be retracted
        ([P], X),
        ([P], Q),  # nothing goes back to the queue
        ([T], P),  # a decode node never prefills a transferring request
        ([T, R], P),
        ([T, R, X], DONE),  # a retracted request must run again before it finishes
        ([T, R, X], T),
        ([P, T, DONE], R),  # finished is terminal
        ([P, R], R),  # no self-loops: a repeated move is a bookkeeping bug
    ],
)
def test_illegal_transition_raises_and_keeps_state(path, bad):
    r = new_request()
    walk(r, path)
    before = r.state
    with pytest.raises(IllegalTransition, match=f"r0: illegal transition {before.name} -> {bad.name}"):
        r.transition(bad)
    assert r.state is before


def test_assigning_state_is_checked_too():
    r = new_request()
    r.state = RequestState.PREFILLING
    assert r.state is P
    with pytest.raises(IllegalTransition):
        r.state = RequestState.QUEUED
    assert r.state is P
