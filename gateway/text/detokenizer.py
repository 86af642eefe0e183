"""Incremental detokenization and stop strings for one generation.

`IncrementalDetokenizer` uses the prefix/read-offset scheme (vLLM, SGLang): decode a short window
of already-read tokens plus the new ones, and emit only what extends the window's text and does not
end in U+FFFD, so a multi-byte character split across tokens is never emitted half-way.

`StopStringMatcher` works on the cumulative text: once a stop string appears, the text is cut just
before it (OpenAI/SGLang semantics); until then it releases only text that cannot be the start of a
stop string. Its cost is linear in the text and the stop strings' length.
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
    """Feeds on stable text; tells what may be released and whether a stop string matched.

    One Knuth-Morris-Pratt automaton per stop string, advanced one character at a time: each
    character costs O(1) amortized per stop string, however long the strings (a longest-suffix
    search per feed was quadratic in their length). The first stop string to complete wins (of
    those completing on the same character, the longest); text that could still be the start of
    one (the longest automaton state) is held back. The result does not depend on how the text
    is split into feeds.
    """

    def __init__(self, stops: Sequence[str], keep_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        # SGLang's no_stop_trim: the text ends after the matched stop string instead of before it.
        self.keep_stop = keep_stop
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # chars of each stop string matched at the text's end
        self.text = ""  # all stable text seen (cut at the stop string once matched)
        self.released = 0  # chars of `text` already handed out
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add stable text; return the text now safe to release."""
        if self.matched is not None or not delta:
            return ""
        if not self.stops:
            self.text += delta
            return self._release(len(self.text))
        for i, ch in enumerate(delta):
            hit = self._step(ch)
            if hit is not None:
                end = len(self.text) + i + 1
                self.matched = hit
                self.text = (self.text + delta[: i + 1])[: end - (0 if self.keep_stop else len(hit))]
                return self._release(len(self.text))
        self.text += delta
        return self._release(len(self.text) - max(self._state))

    def finish(self) -> str:
        """No more text will come: release what was held back."""
        if self.matched is not None:
            return ""
        return self._release(len(self.text))

    def _step(self, ch: str) -> str | None:
        """Advance every automaton by `ch`; the stop string completed by it, if any."""
        hit: str | None = None
        for j, s in enumerate(self.stops):
            q, fail = self._state[j], self._fail[j]
            while q and s[q] != ch:
                q = fail[q - 1]
            if s[q] == ch:
                q += 1
            if q == len(s):
                if hit is None or len(s) > len(hit):
                    hit = s
                q = fail[q - 1]
            self._state[j] = q
        return hit

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released : upto]
        self.released = upto
        return out


def _failure(s: str) -> list[int]:
    """KMP's prefix function: fail[i] = length of the longest proper prefix of s[: i + 1] that is
    also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
