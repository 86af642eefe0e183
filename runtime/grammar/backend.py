"""The grammar backend: compile a request's constraint for the model's tokenizer, cached by its text.

A constraint is one of `SamplingParams.json_schema`, `.regex` or `.ebnf` (`SamplingParams.constraint`
gives it as a (kind, text) pair). The backend turns it into a compiled grammar: for every parser
state, which of the vocabulary's tokens may come next. That is the expensive part (milliseconds for
a small schema, more for large ones), so compiled grammars are kept in an LRU cache keyed by
(kind, text); a constraint that fails to compile is cached too (as its error), so a client that
repeats a bad schema costs nothing. Each request then gets its own cheap `GrammarMatcher`
(matcher.py) over the shared compiled grammar.

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
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdserve.runtime.grammar.matcher import GrammarMatcher

log = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("xgrammar", "none")
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf")


class InvalidGrammar(ValueError):
    """A constraint that does not compile; `kind` names the field (json_schema, regex, ebnf)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"invalid {kind}: {message}")
        self.kind = kind


@dataclass
class CompileStats:
    """Counters of one backend's cache (read by tests and the benchmark)."""

    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # sum over misses
    last_compile_seconds: float = 0.0


class GrammarBackend:
    """xgrammar over one tokenizer: compile (cached) and hand out matchers. Thread-safe."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...] | list[int],
        cache_size: int = 256,
    ):
        import xgrammar as xgr  # heavy import, only where a grammar is used

        t0 = time.perf_counter()
        # vocab_size is the model's logits width, which may exceed the tokenizer's (padding rows).
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # Our own cache below keys on the constraint text; xgrammar's would duplicate it.
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # value: compiled or InvalidGrammar
        self._lock = threading.Lock()
        log.info("grammar backend xgrammar ready in %.0f ms", 1e3 * (time.perf_counter() - t0))

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of (kind, text); raises InvalidGrammar. Cached by (kind, text)."""
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = self._compile(kind, text)
            except InvalidGrammar as e:
                hit = e
            dt = time.perf_counter() - t0
            with self._lock:
                self.stats.misses += 1
                self.stats.compile_seconds += dt
                self.stats.last_compile_seconds = dt
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            log.info("compiled %s grammar (%d chars) in %.1f ms", kind, len(text), 1e3 * dt)
        if isinstance(hit, InvalidGrammar):
            raise hit
        return hit

    def validate(self, kind: str, text: str) -> None:
        self.compile(kind, text)

    def matcher(self, kind: str, text: str) -> GrammarMatcher:
        return GrammarMatcher(self.compile(kind, text), self.vocab_size)

    def _compile(self, kind: str, text: str) -> Any:
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
                return self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except InvalidGrammar:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            raise InvalidGrammar(kind, _first_line(str(e))) from None


def _first_line(msg: str) -> str:
    """The compiler's complaint without its log prefix ("[hh:mm:ss] file.cc:123: ")."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", lines[0]) if lines else "does not compile"


def make_grammar_backend(
    name: str, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...] | list[int]
) -> GrammarBackend | None:
    """The backend named by --grammar-backend; None for `none`."""
    if name == "none":
        return None
    if name != "xgrammar":
        raise ValueError(f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}")
    return GrammarBackend(hf_tokenizer, vocab_size, stop_token_ids)
