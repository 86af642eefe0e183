"""Incremental detokenization and stop strings for one generation.

`IncrementalDetokenizer` uses the prefix/read-offset scheme (vLLM, SGLang): decode a short window
of already-read tokens plus the new ones, and emit only what extends the window's text and does not
end in U+FFFD, so a multi-byte character split across tokens is never emitted half-way.

`StopStringMatcher` works on the cumulative text: once a stop string appears, the text is cut just
before it (OpenAI/SGLang semantics); until then it releases only text that cannot be the start of a
stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Prompt tokens kept as left context so the first output token decodes as it would mid-sequence
# (SentencePiece-style tokenizers drop a leading space at the very start of a decode).
_CONTEXT_TOKENS = 5

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Feeds on stable text; tells what may be released and whether a stop string matched."""

    def __init__(self, stops: Sequence[str], keep_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        # SGLang's no_stop_trim: the text ends after the matched stop string instead of before it.
        self.keep_stop = keep_stop
        self._max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all stable text seen (cut at the stop string once matched)
        self.released = 0  # chars of `text` already handed out
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add stable text; return the text now safe to release."""
        if self.matched is not None or not delta:
            return ""
        # A match can only involve the new text plus the last (max_len - 1) old chars.
        start = max(0, len(self.text) - self._max_len + 1)
        self.text += delta
        hit = self._find(start)
        if hit is not None:
            pos, stop = hit
            self.matched = stop
            self.text = self.text[: pos + (len(stop) if self.keep_stop else 0)]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def finish(self) -> str:
        """No more text will come: release what was held back."""
        if self.matched is not None:
            return ""
        return self._release(len(self.text))

    def _find(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        n = min(len(self.text), self._max_len - 1)
        for k in range(n, 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released : upto]
        self.released = upto
        return out
