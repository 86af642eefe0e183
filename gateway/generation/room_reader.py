"""One attempt's room as its generation reads it: the events that count, in order, until the deadline,
and which legs to abort when the room closes.

The first token comes twice: with PrefillDone, as soon as the prefill sampled it, and with the decode's
first output, once the KV landed. Whichever comes first counts; the other is dropped (the decode's
output less its first token). Once the decode leg has sent tokens it holds the attempt's KV: the prefill
leg is no longer needed, and its failure is no longer the request's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from pdserve.gateway.cluster.rooms import LegFailed, Room, RoomAborted, RoomEvent, TokensArrived
from pdserve.protocol.gateway import PrefillDone, TokenOutput
from pdserve.protocol.vocabulary import AbortReason, FailCode

log = logging.getLogger(__name__)


class RoomReader:
    def __init__(self, room: Room, deadline: float) -> None:
        """`deadline`: epoch seconds, the request's (`GenerateRequest.deadline_s`)."""
        self.room, self.deadline = room, deadline
        # Legs to abort when the room closes; cleared as the request reaches a clean end.
        self.abort_decode: AbortReason | None = AbortReason.CANCELLED if room.decode is not None else None
        self.abort_prefill: AbortReason | None = AbortReason.CANCELLED if room.prefill is not None else None
        self.first_early = False  # the prefill's copy of the first token counted
        self.decode_spoke = False  # the decode leg sent tokens: it holds this attempt's KV

    async def next(self) -> RoomEvent:
        """The next event that counts: tokens not seen yet, or the end of the attempt (a leg failed, the
        gateway ended the room, or the deadline passed)."""
        while True:
            try:
                ev = await asyncio.wait_for(
                    self.room.inbox.get(), timeout=max(0.0, self.deadline - time.time())
                )
            except TimeoutError:  # asyncio.TimeoutError is this class from 3.11
                return RoomAborted(FailCode.DEADLINE, "the request's deadline passed")
            if isinstance(ev, RoomAborted) or (isinstance(ev, LegFailed) and ev.code == FailCode.DEADLINE):
                return ev
            if isinstance(ev, LegFailed):
                if ev.role == "prefill" and self.decode_spoke:
                    log.info("room %s: prefill leg lost after the KV arrived: %s", self.room.room, ev.message)
                    self.abort_prefill = None
                    continue
                if ev.reported:  # the failing leg has ended: abort only the other one
                    self.abort_decode = None if ev.role == "decode" else AbortReason.OTHER_LEG_FAILED
                    self.abort_prefill = None if ev.role == "prefill" else AbortReason.OTHER_LEG_FAILED
                return ev
            if ev.source == "prefill":
                if self.decode_spoke:
                    continue
                self.first_early = True
            elif ev.output.token_ids:
                if self.first_early and not self.decode_spoke:
                    ev = replace(ev, output=_without_first(ev.output))
                self.decode_spoke = True
            self._local_prefill_done(ev)
            return ev

    def _local_prefill_done(self, ev: TokensArrived) -> None:
        """A local prefill: the decode worker's first output stands in for PrefillDone."""
        room, out = self.room, ev.output
        if out.prefill_events is not None and room.prefill is None and room.prefill_done is None:
            room.prefill_done = PrefillDone(room=room.room, events=out.prefill_events)
            room.prefill_done_at = ev.t_recv
            room.prefill_event.set()

    def finished(self, decode_finished: bool) -> None:
        """The request finished; `decode_finished`: with the decode leg's own finish."""
        # The decode finished, or will on its own: the prefill's first token ended the request (the
        # decode, given the same token, stops there too once the KV lands). Unless a stop string
        # matched before the decode finished.
        self.abort_decode = None if decode_finished else AbortReason.STOP
        self.abort_prefill = None if self.room.prefill_done is not None else AbortReason.FINISHED


def _without_first(out: TokenOutput) -> TokenOutput:
    """The decode's first output less the first token, which the prefill's PrefillDone delivered."""
    return out.model_copy(
        update={
            "token_ids": out.token_ids[1:],
            "logprobs": out.logprobs[1:] if out.logprobs is not None else None,
            "top_logprobs": out.top_logprobs[1:] if out.top_logprobs is not None else None,
        }
    )
