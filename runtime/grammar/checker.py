"""Does a constraint compile? Asked of child processes that are killed when a compile runs too long.

The gateway only needs a verdict on each constraint (a 400 naming the problem, or on to the workers),
never the compiled grammar. A compile cannot be stopped inside a process (xgrammar has no cancel), and
one that runs past --grammar-compile-timeout would go on taking a core and hundreds of MB for minutes
(a 300 KB EBNF of 30k alternatives: the gateway's memory grew 500 MB while it ran on). So each compile
runs in a child (check_child.py) that is killed at the timeout; killing it frees all it held, and a
fresh child is started at the next check.

At most `processes` compiles run at once; more wait for a free child (their wait counts against their
timeout). Verdicts are cached by (kind, text digest), bounded in entries, so a repeated schema costs a
lookup. A child starts in about a second (xgrammar's import and the tokenizer's vocabulary); its start
does not count against the compile's timeout.
"""

from __future__ import annotations

import hashlib
import json
import selectors
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import IO

from pdserve.runtime.grammar.backend import CompileTimeout, InvalidGrammar

START_TIMEOUT_S = 60.0  # a child's import and set-up, on a loaded machine
VERDICTS_KEPT = 4096


class _Child:
    """One compiling child, started and set up at construction."""

    def __init__(self, info_json: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "pdserve.runtime.grammar.check_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )  # it ends at its stdin's end, so with this process (and with its process group)
        self._send({"info": info_json})
        if self._reply(START_TIMEOUT_S) is None:
            self.kill()
            raise RuntimeError("the grammar checker process did not start")

    def ask(self, kind: str, text: str, timeout_s: float) -> str | None | bool:
        """The compiler's error (None: it compiles), or False when the child took longer than `timeout_s`
        or died (it is then killed)."""
        try:
            self._send({"kind": kind, "text": text})
        except OSError:
            self.kill()
            return False
        reply = self._reply(timeout_s)
        if reply is None:
            self.kill()
            return False
        error = reply.get("error")
        return error if isinstance(error, str) else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def _send(self, obj: dict[str, str]) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(obj).encode() + b"\n")
        stdin.flush()

    def _reply(self, timeout_s: float) -> dict[str, object] | None:
        out = self.proc.stdout
        assert out is not None
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                return None
        line = out.readline()  # the child writes each reply as one line, at once
        if not line:
            return None
        reply = json.loads(line)
        return reply if isinstance(reply, dict) else None


class GrammarChecker:
    """Tells whether constraints compile; thread-safe. `info_json` is xgrammar's TokenizerInfo
    (`serialize_json`) of the model's tokenizer."""

    def __init__(self, info_json: str, timeout_s: float, processes: int = 2) -> None:
        if timeout_s <= 0:
            raise ValueError("--grammar-compile-timeout must be > 0")
        self.info_json = info_json
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(processes)
        self._idle: list[_Child] = []
        self._verdicts: OrderedDict[tuple[str, bytes], str | None] = OrderedDict()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a child became idle, or a start ended
        self._starting = 0  # replacements starting in the background
        self.killed = 0  # children killed at the timeout (read by tests)

    def check(self, kind: str, text: str) -> None:
        """Returns if (kind, text) compiles; raises InvalidGrammar with the compiler's complaint, or
        CompileTimeout when the compile (with its wait for a free child) passed the timeout."""
        key = (kind, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest())
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                self._raise(kind, self._verdicts[key])
                return
        waited = time.monotonic()
        if not self._slots.acquire(timeout=self.timeout_s):
            raise CompileTimeout(kind, self.timeout_s)
        waited = time.monotonic() - waited
        try:
            child = self._take()  # a fresh child's start is not the compile's time
            verdict = child.ask(kind, text, max(0.0, self.timeout_s - waited))
            if verdict is False:
                self.killed += 1
                # Its replacement starts now, beside the requests, not in the next one's wait.
                with self._lock:
                    self._starting += 1
                threading.Thread(target=self._replace, name="grammar-checker-start", daemon=True).start()
                raise CompileTimeout(kind, self.timeout_s)
            with self._lock:
                self._idle.append(child)
                self._changed.notify()
        finally:
            self._slots.release()
        error = verdict if isinstance(verdict, str) else None
        with self._lock:
            self._verdicts[key] = error
            while len(self._verdicts) > VERDICTS_KEPT:
                self._verdicts.popitem(last=False)
        self._raise(kind, error)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _replace(self) -> None:
        child = None
        try:
            child = _Child(self.info_json)
        except (OSError, RuntimeError):
            pass  # the next check starts one
        with self._lock:
            self._starting -= 1
            if child is not None:
                self._idle.append(child)
            self._changed.notify_all()

    def _take(self) -> _Child:
        """An idle child, or the replacement being started, or a new one."""
        with self._lock:
            while True:
                while self._idle:
                    child = self._idle.pop()
                    if child.alive():
                        return child
                    child.kill()
                if not self._starting:
                    break
                self._changed.wait()
        return _Child(self.info_json)

    @staticmethod
    def _raise(kind: str, error: str | None) -> None:
        if error is not None:  # the child's str(InvalidGrammar): "invalid <kind>: <complaint>"
            raise InvalidGrammar(kind, error.removeprefix(f"invalid {kind}: "))
