"""A request's life on one node: its states and every legal move between them, in one table.

Offline engine: QUEUED -> PREFILLING -> RUNNING -> FINISHED (PREFILLING -> FINISHED when the first
                token already ends the request)
Prefill node:   QUEUED -> PREFILLING -> TRANSFERRING (KV on its way out) -> FINISHED
Decode node:    QUEUED -> TRANSFERRING (pages held, KV on its way in) -> RUNNING -> FINISHED,
                RUNNING -> RETRACTED (pages freed under pool pressure) -> RUNNING (KV recomputed),
                TRANSFERRING -> QUEUED (the prefill node refused the cached prefix: asked again in full),
                QUEUED -> PREFILLING -> RUNNING (a local prefill: no prefill node takes part)
Every live state may go to FAILED (abort, failed transfer). FINISHED and FAILED are terminal.
QUEUED -> RUNNING is the decode path for a prompt whose KV was computed on this node without a
transfer (code that drives a stepper by hand does this).

Only the owning process's scheduling loop moves a request, so states need no lock.
"""

from __future__ import annotations

import enum


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting for admission; no pages
    PREFILLING = "prefilling"  # pages held; prompt chunks still to run
    TRANSFERRING = "transferring"  # pages held; the prompt's KV is moving between nodes
    RUNNING = "running"  # in the decode batch
    RETRACTED = "retracted"  # pages freed under pool pressure; outputs kept
    FINISHED = "finished"
    FAILED = "failed"  # aborted or failed; pages freed


_S = RequestState
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    _S.QUEUED: frozenset({_S.PREFILLING, _S.TRANSFERRING, _S.RUNNING, _S.FAILED}),
    _S.PREFILLING: frozenset({_S.TRANSFERRING, _S.RUNNING, _S.FINISHED, _S.FAILED}),
    _S.TRANSFERRING: frozenset({_S.QUEUED, _S.RUNNING, _S.FINISHED, _S.FAILED}),
    _S.RUNNING: frozenset({_S.RETRACTED, _S.FINISHED, _S.FAILED}),
    _S.RETRACTED: frozenset({_S.RUNNING, _S.FAILED}),
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
}
TERMINAL = frozenset({_S.FINISHED, _S.FAILED})


class IllegalTransition(RuntimeError):
    pass


def check_transition(room: str, old: RequestState, new: RequestState) -> None:
    """Raise IllegalTransition unless `old -> new` is in the table."""
    if new not in _ALLOWED[old]:
        raise IllegalTransition(f"request {room}: illegal transition {old.name} -> {new.name}")
