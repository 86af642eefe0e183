"""Tool calls out of an output, streamed or whole.

`ToolCallStream` feeds on text deltas. Before the tool-call section it releases content, holding back
a tail that may be the start of the section's marker. Inside the section it releases nothing as text
and, at each delta that may close something (holds `}`, `]` or `>`), asks the format for the complete
calls so far: every new one is released whole
(name and full arguments), which OpenAI's streaming allows and every client reassembles by index. At
the end, a section with no valid call is released as content after all (the model wrote something
that only looked like a call). Calls to functions not in the request's tools are dropped.
"""

from __future__ import annotations

import logging

from pdserve.gateway.text.function_call.base import ParsedCall, ToolCallFormat, call_from_json

log = logging.getLogger(__name__)


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat, names: set[str], parallel: bool = True) -> None:
        self.fmt, self.names, self.parallel = fmt, names, parallel
        self.text = ""  # everything fed
        self.released = 0  # chars of `text` released as content
        self.section: int | None = None  # where the tool-call section starts in `text`
        self.seen = 0  # call objects of the section already looked at
        self.calls: list[ParsedCall] = []

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """(content delta, new calls)."""
        self.text += delta
        if self.section is not None and not any(ch in delta for ch in "}]>"):
            return "", []  # inside the section, a call can only complete with a closing character
        return self._step(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        content, calls = self._step(final=True)
        if self.section is not None and not self.calls:
            content += self.text[self.released :]  # no call after all: it was content
            self.released = len(self.text)
        return content, calls

    def _step(self, final: bool) -> tuple[str, list[ParsedCall]]:
        if self.section is None:
            start = self.fmt.find_start(self.text)
            if start < 0:
                upto = len(self.text) if final else len(self.text) - self.fmt.holdback(self.text)
                return self._release(upto), []
            self.section = start
        content = self._release(self.section)
        objs = self.fmt.calls(self.text[self.section :], final)
        new: list[ParsedCall] = []
        for obj in objs[self.seen :]:
            call = call_from_json(obj)
            if call is None or call.name not in self.names:
                log.warning("dropping a tool call to an unknown function or of the wrong shape: %.200s", obj)
            elif self.parallel or not self.calls:
                self.calls.append(call)
                new.append(call)
        self.seen = len(objs)
        return content, new

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released : upto]
        self.released = upto
        return out


def parse_tool_calls(
    fmt: ToolCallFormat, text: str, names: set[str], parallel: bool = True
) -> tuple[str, list[ParsedCall]]:
    """A whole output: (content, calls)."""
    s = ToolCallStream(fmt, names, parallel)
    c1, k1 = s.feed(text)
    c2, k2 = s.finish()
    return c1 + c2, k1 + k2
