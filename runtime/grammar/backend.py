"""The grammar backend: compile a request's constraint for the model's tokenizer, in the background,
cached by its text.

A constraint is one of `SamplingParams.json_schema`, `.regex` or `.ebnf` (`SamplingParams.constraint`
gives it as a (kind, text) pair). The backend turns it into a compiled grammar: for every parser
state, which of the vocabulary's tokens may come next. That is the expensive part: milliseconds for
a small schema, but it grows with the grammar (about 0.5 ms per character class in a chain on one
core of the CI machine: a 36 KB EBNF of 6000 classes takes 3 s, 300 KB took 20 s), so:

- Compiles run on a small pool of threads (`COMPILE_THREADS`), never on the caller's: a worker's
  scheduler thread or the gateway's event loop keeps going while one runs. xgrammar releases the GIL
  while it compiles (measured: a Python loop on the main thread kept running, its longest pause 7 ms,
  during a 3.4 s compile on another thread), so threads suffice and nothing is serialized (a
  compiled grammar's JSON is ~40 MB for that 3 s grammar and takes 0.9 s to read back). Each compile
  uses one thread of its own (xgrammar's `max_threads=1`), at a lower priority (nice 10), so the pool
  takes at most `COMPILE_THREADS` cores and yields them to the forwards.
- `submit` gives a Future; `compile` waits for it at most `compile_timeout_s`
  (--grammar-compile-timeout) and then raises `CompileTimeout`, an `InvalidGrammar` naming the flag.
  A compile already running cannot be stopped (xgrammar has no cancel): it finishes on its pool
  thread, and its result is cached, so a retry of the same grammar is served. A compile still queued
  when every request that asked for it has given up is skipped. So abandoned work is bounded by the
  pool: at most `COMPILE_THREADS` cores, each for one compile's length (which the gateway's
  --max-request-bytes bounds).
- Two requests for the same (kind, text) share one compile.
- Compiled grammars are kept in an LRU cache keyed by (kind, text), bounded in entries and in bytes
  (cache.py; `memory_size_bytes` as xgrammar reports it). A constraint that fails to compile is
  cached too (as its error), so a client that repeats a bad schema costs nothing.

Each request then gets its own cheap `GrammarMatcher` (matcher.py) over the shared compiled grammar.

Backend: xgrammar, chosen by measurement against llguidance and outlines-core on the bundled
model's 49152-token vocabulary (docs/benchmarks.md): fastest mask fill, fast compiles, and it takes
JSON schema, regex and EBNF alike, with rollback for speculative decoding. `--grammar-backend none`
turns structured output off (requests that carry a constraint are refused).

The gateway builds a backend from its own tokenizer to validate constraints (an invalid schema or
regex is an HTTP 400 naming the problem) before any worker sees them; the workers build theirs
lazily, at the first constrained request, so a worker that never sees one never loads it.

JSON is generated compactly (no free whitespace): small models given free whitespace tend to emit
newlines until max_new_tokens runs out.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.config import GRAMMAR_COMPILE_TIMEOUT_S
from pdserve.runtime.grammar.cache import BoundedLRU
from pdserve.runtime.grammar.matcher import GrammarMatcher

log = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("xgrammar", "none")
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf")
# --grammar-compile-timeout's default (10 s): well above any schema a client sends in practice (the
# benchmark's largest compiles in ~0.2 s), well below a client's patience.
DEFAULT_COMPILE_TIMEOUT_S = GRAMMAR_COMPILE_TIMEOUT_S
COMPILE_THREADS = 2  # compiles at once per process; more wait in the pool's queue
COMPILE_NICE = 10  # the pool threads' niceness (see _lower_priority)
CACHE_MAX_ENTRIES = 256
# 256 MiB per process: thousands of ordinary schemas, or a handful of 100 KB grammars.
CACHE_MAX_BYTES = 256 << 20


class InvalidGrammar(ValueError):
    """A constraint that does not compile; `kind` names the field (json_schema, regex, ebnf)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"invalid {kind}: {message}")
        self.kind = kind


class CompileTimeout(InvalidGrammar):
    """A constraint whose compile did not end within --grammar-compile-timeout."""

    def __init__(self, kind: str, timeout_s: float):
        ValueError.__init__(
            self,
            f"the {kind} constraint did not compile within {timeout_s:g} s "
            "(--grammar-compile-timeout); simplify it or raise the flag",
        )
        self.kind = kind


@dataclass
class CompileStats:
    """Counters of one backend's cache (read by tests and the benchmark)."""

    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # sum over misses
    last_compile_seconds: float = 0.0
    skipped: int = 0  # queued compiles dropped: every request that asked had given up


@dataclass
class _Job:
    """One compile in the pool; `deadline` (time.monotonic) is the latest of its waiters'."""

    future: Future[Any]
    deadline: float


class GrammarBackend:
    """xgrammar over one tokenizer: compile (in the background, cached) and hand out matchers.
    Thread-safe."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...] | list[int],
        cache_size: int = CACHE_MAX_ENTRIES,
        cache_bytes: int = CACHE_MAX_BYTES,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ):
        import xgrammar as xgr  # heavy import, only where a grammar is used

        if compile_timeout_s <= 0:
            raise ValueError("--grammar-compile-timeout must be > 0")
        t0 = time.perf_counter()
        info = tokenizer_info(hf_tokenizer, vocab_size, stop_token_ids)
        # Our own cache below keys on the constraint text; xgrammar's would duplicate it. One thread
        # per compile (xgrammar's default is 8): measured on 2 loaded cores, a compile on 8 threads
        # made a torch loop beside it 7.5x slower per step, on 1 thread 2x (the compile itself 2x slower).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.stats = CompileStats()
        self.cache: BoundedLRU[tuple[str, str], Any] = BoundedLRU(cache_size, cache_bytes)
        self._inflight: dict[tuple[str, str], _Job] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="grammar-compile", initializer=_lower_priority
        )
        log.info("grammar backend xgrammar ready in %.0f ms", 1e3 * (time.perf_counter() - t0))

    def submit(self, kind: str, text: str) -> Future[Any]:
        """A Future of the compiled grammar of (kind, text), which raises InvalidGrammar; done at once
        on a cache hit. The caller bounds its wait (`compile`, or runtime/grammar/waits.py)."""
        key = (kind, text)
        deadline = time.monotonic() + self.compile_timeout_s
        with self._lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.stats.hits += 1
                return _resolved(hit)
            job = self._inflight.get(key)
            if job is not None:  # the same grammar is compiling for another request: share it
                job.deadline = max(job.deadline, deadline)
                return job.future
            job = self._inflight[key] = _Job(Future(), deadline)
        self._pool.submit(self._run, key, job)
        return job.future

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of (kind, text), waiting for it at most `compile_timeout_s`; raises
        InvalidGrammar (CompileTimeout past the wait). Cached by (kind, text)."""
        try:
            return self.submit(kind, text).result(timeout=self.compile_timeout_s)
        except TimeoutError:
            raise CompileTimeout(kind, self.compile_timeout_s) from None

    def validate(self, kind: str, text: str) -> None:
        self.compile(kind, text)

    def matcher(self, kind: str, text: str) -> GrammarMatcher:
        return GrammarMatcher(self.compile(kind, text), self.vocab_size)

    def close(self) -> None:
        """Stop taking compiles; queued ones are dropped, a running one ends on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, key: tuple[str, str], job: _Job) -> None:
        kind, text = key
        with self._lock:
            stale = time.monotonic() > job.deadline
            if stale:
                self.stats.skipped += 1
                del self._inflight[key]
        if stale:
            job.future.set_exception(CompileTimeout(kind, self.compile_timeout_s))
            return
        t0 = time.perf_counter()
        try:
            hit: Any = self._compile(kind, text)
            size = int(hit.memory_size_bytes) + len(text)
        except InvalidGrammar as e:
            hit, size = e, len(text) + len(str(e))
        except Exception as e:  # out of memory, or a compiler fault: this request fails, not its waiters
            with self._lock:
                del self._inflight[key]
            log.exception("compiling a %s grammar (%d chars) failed", kind, len(text))
            job.future.set_exception(InvalidGrammar(kind, f"the compiler failed ({type(e).__name__})"))
            return
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += dt
            self.stats.last_compile_seconds = dt
            kept = self.cache.put(key, hit, size)
            del self._inflight[key]
        log.info(
            "compiled %s grammar (%d chars, %.1f MB%s) in %.1f ms",
            kind,
            len(text),
            size / 1e6,
            "" if kept else ", larger than the cache: not kept",
            1e3 * dt,
        )
        if isinstance(hit, InvalidGrammar):
            job.future.set_exception(hit)
        else:
            job.future.set_result(hit)

    def _compile(self, kind: str, text: str) -> Any:
        return compile_constraint(self._compiler, kind, text)


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...] | list[int]) -> Any:
    """xgrammar's TokenizerInfo of a Hugging Face tokenizer; `vocab_size` is the model's logits width,
    which may exceed the tokenizer's (padding rows)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
    )


def compile_constraint(compiler: Any, kind: str, text: str) -> Any:
    """(kind, text) compiled by an xgrammar GrammarCompiler; raises InvalidGrammar with the compiler's
    complaint."""
    if kind not in CONSTRAINT_KINDS:
        raise InvalidGrammar(kind, f"unknown constraint kind (one of {', '.join(CONSTRAINT_KINDS)})")
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise InvalidGrammar(kind, f"not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise InvalidGrammar(kind, "a JSON schema must be an object")
            return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)
    except InvalidGrammar:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
        raise InvalidGrammar(kind, _first_line(str(e))) from None


def _lower_priority() -> None:
    """Run this pool thread at nice 10 (Linux nices threads one by one): forwards on the same cores
    come first, so a compile takes the cores' idle time rather than the forwards' share."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: compiles run at normal priority
        pass


def _resolved(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    if isinstance(value, InvalidGrammar):
        fut.set_exception(value)
    else:
        fut.set_result(value)
    return fut


def _first_line(msg: str) -> str:
    """The compiler's complaint without its log prefix ("[hh:mm:ss] file.cc:123: ")."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", lines[0]) if lines else "does not compile"


def make_grammar_backend(
    name: str,
    hf_tokenizer: Any,
    vocab_size: int,
    stop_token_ids: tuple[int, ...] | list[int],
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
) -> GrammarBackend | None:
    """The backend named by --grammar-backend; None for `none`."""
    if name == "none":
        return None
    if name != "xgrammar":
        raise ValueError(f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}")
    return GrammarBackend(hf_tokenizer, vocab_size, stop_token_ids, compile_timeout_s=compile_timeout_s)
