"""Reasoning parsers (`--reasoning-parser`): thinking text out of the answer, whole or streamed.

The `<think>...</think>` family, with SGLang's names:
- `deepseek-r1`: the chat template opens the thinking block itself, so the output starts inside it
  (`force`): everything up to `</think>` is reasoning, even without a `<think>` in the output (one
  written anyway is dropped).
- `qwen3`: the output is reasoning only when it starts with `<think>` (Qwen3 writes it itself; with
  `enable_thinking: false` its template closes an empty block in the prompt and the output is all answer).
- `qwen3-thinking`: Qwen3's thinking-only models, which behave like deepseek-r1.

A block that never closes (the generation ran out of tokens) is all reasoning. `ReasoningStream` feeds
on text deltas and holds back a tail that could be the start of a marker, so a marker split across
chunks is never emitted as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    # The output begins inside the thinking block (the template opened it).
    force: bool = False

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        s = ReasoningStream(self)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return r1 + r2, c1 + c2


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(force=True),
    "qwen3": ReasoningFormat(force=False),
    "qwen3-thinking": ReasoningFormat(force=True),
}


def reasoning_format(name: str | None, template_kwargs: dict[str, Any] | None) -> ReasoningFormat | None:
    """The format for one request; None when reasoning stays in the content.

    `enable_thinking: false` (Qwen3's template switch) turns thinking off, so there is nothing to split.
    """
    if name is None or (template_kwargs or {}).get("enable_thinking") is False:
        return None
    return REASONING_PARSERS[name]


class ReasoningStream:
    """Incremental split of one output into reasoning and content deltas."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        # "start": before any text (a <think> may open); "think": inside; "gap": just after the block;
        # "answer": after it.
        self.state = "start"
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) now safe to release."""
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                head = self._buf.lstrip()
                if head.startswith(self.fmt.start):
                    self._buf = head[len(self.fmt.start) :]
                    self.state = "think"
                    continue
                if self.fmt.start.startswith(head):  # may still become <think> (or only whitespace so far)
                    return reasoning, content
                self.state = "think" if self.fmt.force else "answer"
                continue
            if self.state == "think":
                pos = self._buf.find(self.fmt.end)
                if pos >= 0:
                    reasoning += self._buf[:pos]
                    self._buf = self._buf[pos + len(self.fmt.end) :]
                    self.state = "gap"
                    continue
                keep = _partial_suffix(self._buf, self.fmt.end)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, content
            if self.state == "gap":  # whitespace between the block and the answer is dropped
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return reasoning, content
                self.state = "answer"
            content += self._buf
            self._buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: release what was held back."""
        rest, self._buf = self._buf, ""
        if self.state == "think" or (self.state == "start" and self.fmt.force):
            return rest, ""
        return "", rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
