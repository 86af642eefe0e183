"""One generation's outputs into what the client sees: released text, token ids, logprobs, finish state.

The same `Collector` carries on across a generation's attempts (a retry or migrations), so the
detokenizer and the stop strings see one stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from typing_extensions import TypedDict

from pdserve.gateway.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.protocol.gateway import TokenOutput
from pdserve.protocol.records import DecodeEvents, RequestStats
from pdserve.protocol.vocabulary import FinishReason, finish_length, finish_stop

if TYPE_CHECKING:
    from pdserve.gateway.generation.generation import GenInput, GenState

DecodeEvent = Literal["decode_entry", "kv_requested", "kv_ready", "finished"]
_DECODE_EVENTS: tuple[DecodeEvent, ...] = ("decode_entry", "kv_requested", "kv_ready", "finished")


class WeightSegment(TypedDict):
    """Output tokens [start, end) made by the weights of `version`."""

    version: str
    start: int
    end: int


def count_version(segments: list[WeightSegment], version: str, end: int) -> None:
    """One more output token (the `end`-th) made by `version`: extend the last segment or start one."""
    if segments and segments[-1]["version"] == version:
        segments[-1]["end"] = end
    else:
        segments.append({"version": version, "start": end - 1, "end": end})


class Collector:
    """Turns the decode's outputs for one generation into released text, ids and finish state."""

    def __init__(self, tok: Tokenizer, inp: GenInput, st: GenState) -> None:
        skip = inp.skip_special_tokens
        self.detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip), inp.input_ids)
        self.stop = StopStringMatcher(inp.sampling.stop, inp.sampling.no_stop_trim)
        self.st = st
        # On the gateway clock: a migrated request's legs ran on decode workers with other offsets.
        # The first leg's entry and KV arrival, the last leg's finish.
        self.decode_events: DecodeEvents = {}
        self.stats: RequestStats = {}
        self.first_token_recv: float | None = None
        self.last_recv: float | None = None
        self.final_recv: float = 0.0
        self.failed: str | None = None  # the decode leg finished with an abort: its message

    def feed(self, out: TokenOutput, t_recv: float, decode_offset: float) -> None:
        st = self.st
        events = out.events or {}
        for name in _DECODE_EVENTS:
            t = events.get(name)
            if t is not None and (name == "finished" or name not in self.decode_events):
                self.decode_events[name] = t - decode_offset
        if out.stats:
            self.stats = out.stats
        if out.token_ids:
            if self.first_token_recv is None:
                self.first_token_recv = t_recv
            self.last_recv = t_recv
        fr = out.finish_reason if out.finished else None
        if fr is not None and fr["type"] == "abort":
            self.failed = fr["message"]
            return
        # A matched stop token is counted in output_ids but not shown in the text (SGLang).
        hidden_last = (
            fr is not None
            and fr["type"] == "stop"
            and not self.stop.keep_stop
            and bool(out.token_ids)
            and fr["matched"] == out.token_ids[-1]
        )
        for i, tid in enumerate(out.token_ids):
            st.output_ids.append(tid)
            st.new_ids += 1
            count_version(st.weight_versions, out.weight_version, len(st.output_ids))
            if out.logprobs is not None and i < len(out.logprobs):
                st.logprobs.append(out.logprobs[i])
            if out.top_logprobs is not None and i < len(out.top_logprobs):
                st.top_logprobs.append(list(out.top_logprobs[i]))
            if hidden_last and i == len(out.token_ids) - 1:
                break
            self._release(self.stop.feed(self.detok.add(tid)))
            if self.stop.matched is not None:
                self._finish(finish_stop(self.stop.matched), t_recv)
                return
        if out.finished:
            self._release(self.stop.feed(self.detok.flush()))
            if self.stop.matched is not None:
                fr = finish_stop(self.stop.matched)
            self._release(self.stop.finish())
            if fr is None or fr["type"] == "length":
                # The whole generation's length: a migrated leg counts only its own tokens.
                fr = finish_length(len(st.output_ids))
            self._finish(fr, t_recv)

    def _release(self, text: str) -> None:
        self.st.text += text
        self.st.new_text += text

    def _finish(self, reason: FinishReason, t_recv: float) -> None:
        self.st.finished = True
        self.st.finish_reason = reason
        self.final_recv = t_recv
