"""One chat choice's text into reasoning, content and tool calls, streamed or whole.

The output goes through the reasoning parser first (thinking text is never searched for tool calls),
then the answer part through the tool-call parser. Either stage may be off. The same `ChatOutput`
serves a stream (`feed` each text delta, then `finish`) and a whole reply (`whole`), so both give the
same result for the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.gateway.text.function_call import ParsedCall, ToolCallFormat
from pdserve.gateway.text.function_call.stream import ToolCallStream
from pdserve.gateway.text.reasoning import ReasoningFormat, ReasoningStream
from pdserve.gateway.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatOutputSpec:
    """What a request asks of its choices' text."""

    reasoning: ReasoningFormat | None = None
    tools: ToolCallFormat | None = None
    tool_names: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutput:
    def __init__(self, spec: ChatOutputSpec) -> None:
        self.spec = spec
        self._reasoning = ReasoningStream(spec.reasoning) if spec.reasoning else None
        self._tools = (
            ToolCallStream(spec.tools, set(spec.tool_names), spec.parallel_tool_calls) if spec.tools else None
        )

    @property
    def calls(self) -> list[ParsedCall]:
        return self._tools.calls if self._tools else []

    def feed(self, text: str) -> ChatDelta:
        reasoning, answer = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._answer(reasoning, answer, final=False)

    def finish(self) -> ChatDelta:
        reasoning, answer = self._reasoning.finish() if self._reasoning else ("", "")
        return self._answer(reasoning, answer, final=True)

    def _answer(self, reasoning: str, answer: str, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(reasoning, answer)
        content, calls = self._tools.feed(answer)
        if final:
            more, late = self._tools.finish()
            content, calls = content + more, calls + late
        return ChatDelta(reasoning, content, calls)

    def whole(self, text: str) -> ChatDelta:
        a, b = self.feed(text), self.finish()
        return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls)


def reasoning_tokens(tok: Tokenizer, output_ids: list[int], fmt: ReasoningFormat, reasoning: str) -> int:
    """Output tokens up to and including the end of the thinking block (all of them if it never ends)."""
    if not reasoning and not fmt.force:
        return 0
    end_id = tok.token_id(fmt.end)
    if end_id is not None:
        return output_ids.index(end_id) + 1 if end_id in output_ids else len(output_ids)
    # The end marker spans several tokens: the shortest prefix whose text holds it (binary search).
    if fmt.end not in tok.decode(output_ids, skip_special_tokens=False):
        return len(output_ids)
    lo, hi = 1, len(output_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if fmt.end in tok.decode(output_ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo
