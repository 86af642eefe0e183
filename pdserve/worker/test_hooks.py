"""A worker's test hooks: the hidden `--test-*` flags (pdserve/launch/worker_flags.py), as one object.

`TestHooks.from_args` is built once per process, and is None unless a hook flag is set: a serving
worker has no hooks, and none of its code paths asks about one. Where a hook is set, the part it acts
on is built in its faulty form at start, the rest as in serving:
  --test-clock-skew S        the worker's clock runs S seconds ahead (`worker_clock`);
  --test-stall-kv-send S     (prefill) each finished prefill reaches the KV sender S seconds late, as a
                             stuck transfer path would hold it (`HeldSender`);
  --test-stall-kv-data S     (prefill) each announced transfer's data is held back S seconds;
  --test-corrupt-kv N        (prefill) the first N hand-offs get a bit of a page flipped after hashing
                             (both: kv_transfer/send_hooks.py `FaultySend`);
  --test-wrong-tokens-from N (decode) from its Nth request on, every token it decodes reaches the
                             gateway as the next token id, for the canaries (`WrongTokensLink`).
`warn_test_hooks` says in the log, at start, which are set.
"""

from __future__ import annotations

import argparse
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from pdserve.kv_transfer import KVSender, TransferResult, TransferState
from pdserve.kv_transfer.send_hooks import FaultySend
from pdserve.protocol import gateway as m
from pdserve.protocol.kv_trailer import FirstToken
from pdserve.worker.link import WorkerLink


@dataclass(frozen=True)
class TestHooks:
    """The hook flags' values (their `dest`s); the defaults are the flags' defaults: no hook."""

    __test__ = False  # not a pytest test class

    clock_skew_s: float = 0.0
    stall_kv_send_s: float = 0.0
    stall_kv_data_s: float = 0.0
    corrupt_kv: int = 0
    wrong_tokens_from: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TestHooks | None:
        """The hooks `args` set; None when it sets none."""
        none = cls()
        hooks = cls(**{f.name: getattr(args, f.name, getattr(none, f.name)) for f in fields(cls)})
        return None if hooks == none else hooks

    def sender(self, *args: Any, **kw: Any) -> KVSender:
        """A prefill worker's KV sender (KVSender's arguments) with the KV hooks that are set."""
        if self.stall_kv_data_s > 0 or self.corrupt_kv > 0:
            kw["hooks"] = FaultySend(self.stall_kv_data_s, self.corrupt_kv)
        if self.stall_kv_send_s > 0:
            return HeldSender(self.stall_kv_send_s, *args, **kw)
        return KVSender(*args, **kw)

    def link_type(self, vocab_size: int) -> Callable[..., WorkerLink]:
        """The control link's class (WorkerLink's arguments)."""
        if self.wrong_tokens_from > 0:
            return functools.partial(WrongTokensLink, self.wrong_tokens_from, vocab_size)
        return WorkerLink


def worker_clock(hooks: TestHooks | None) -> Callable[[], float]:
    """Epoch seconds on this worker's clock (shifted by --test-clock-skew, if set)."""
    skew = hooks.clock_skew_s if hooks is not None else 0.0
    return (lambda: time.time() + skew) if skew else time.time


class HeldSender(KVSender):
    """--test-stall-kv-send: each send() reaches the sender `stall_s` late (on a timer thread). An
    abort meanwhile ends the room FAILED, as the abort of a transfer under way does."""

    def __init__(self, stall_s: float, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._stall_s = stall_s
        self._held: dict[str, threading.Timer] = {}
        self._held_lock = threading.Lock()

    def send(
        self,
        room: str,
        src_pages: list[int],
        num_tokens: int,
        metadata: FirstToken,
        block_hashes: list[int] | None = None,
    ) -> None:
        timer = threading.Timer(
            self._stall_s, self._release, (room, list(src_pages), num_tokens, metadata, block_hashes)
        )
        timer.daemon = True
        with self._held_lock:
            self._held[room] = timer
        timer.start()

    def _release(
        self, room: str, pages: list[int], num_tokens: int, meta: FirstToken, hashes: list[int] | None
    ) -> None:
        with self._held_lock:  # posted under the lock: an abort never comes before its send
            if self._held.pop(room, None) is not None:
                super().send(room, pages, num_tokens, meta, hashes)

    def abort(self, room: str) -> None:
        with self._held_lock:
            timer = self._held.pop(room, None)
            if timer is None:
                super().abort(room)
                return
        timer.cancel()
        self._publish(TransferResult(room, TransferState.FAILED, None, "aborted by prefill", 0, 0.0))

    def close(self) -> None:
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        for timer in held:
            timer.cancel()
        super().close()


class WrongTokensLink(WorkerLink):
    """--test-wrong-tokens-from N: the link of a decode worker that answers wrong. From the Nth
    GenerateRequest it takes on, each request's tokens after its first (the prefill's) go out as the
    next token id."""

    def __init__(self, wrong_from: int, vocab_size: int, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._wrong_from, self._vocab_size = wrong_from, vocab_size
        self._seen = 0
        self._wrong: dict[str, bool] = {}  # room -> its first token went out

    def recv(self, timeout_s: float) -> list[m.Message]:
        msgs = super().recv(timeout_s)
        for msg in msgs:
            if isinstance(msg, m.GenerateRequest):
                self._seen += 1
                if self._seen >= self._wrong_from:
                    self._wrong[msg.room] = False
        return msgs

    def send(self, msg: m.Message) -> None:
        if isinstance(msg, m.TokenBatch):
            msg = msg.model_copy(update={"outputs": [self._answer(out) for out in msg.outputs]})
        super().send(msg)

    def _answer(self, out: m.TokenOutput) -> m.TokenOutput:
        started = self._wrong.get(out.room)
        if started is None:
            return out
        if out.finished:
            del self._wrong[out.room]
        else:
            self._wrong[out.room] = True
        if not started:
            return out
        wrong = [(t + 1) % self._vocab_size for t in out.token_ids]
        return out.model_copy(update={"token_ids": wrong})


def warn_test_hooks(args: argparse.Namespace, role: str) -> list[str]:
    """One WARNING per test hook (a hidden row of the flag table, `--test-*`) set to anything but its
    default: a worker that stalls, skews its clock or corrupts on purpose must say so in its log, or an
    operator who copied a test's command line would hunt a fault that is a flag. Returns the lines."""
    from pdserve.launch.flags import flags_of

    lines = []
    for f in flags_of(role):
        value = getattr(args, f.attr, None)
        if f.hidden and value != f.default_for(role):
            lines.append(f"{f.name} {value} is set: a hook for tests only, never for serving")
            logging.getLogger(f"pdserve.{role}").warning("%s", lines[-1])
    return lines
