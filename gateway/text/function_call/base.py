"""What every tool-call format provides, and the call record the API returns.

A format says where the tool-call section of an output begins (`find_start`, and how much of an
output's tail may still turn into its start: `holdback`), which complete calls a section holds so far
(`calls`), and how a call and the instructions to make one are written into a prompt (used when the
chat template has no tool support: see prompt.py). Everything before the section is the answer's
content. A section that holds no valid call by the end of the output was not one: it is content.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments`
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_from_json(obj: Any) -> ParsedCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> a call; anything else -> None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def decode_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `pos` (after whitespace) and the index after it; None if incomplete/invalid."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallFormat(ABC):
    """One model family's way of writing tool calls; stateless."""

    start: str  # the marker that opens the tool-call section

    def find_start(self, text: str) -> int:
        """Index where the tool-call section begins in the output so far, or -1."""
        return text.find(self.start)

    def holdback(self, text: str) -> int:
        """Chars at the end of `text` (no section found) that may still become the section's start."""
        return partial_suffix(text, self.start)

    @abstractmethod
    def calls(self, section: str, final: bool) -> list[Any]:
        """The complete call objects (parsed JSON) in `section` (which starts at the marker), in order.

        `final`: the output has ended, so a last call without its closing tag counts if its JSON is whole.
        """

    @abstractmethod
    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model writes it (for the history and the fallback prompt's example)."""

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(self.render_call(n, a) for n, a in calls)
