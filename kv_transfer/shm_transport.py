"""The KV transport between two nodes of one host: the decode node copies a room's pages out of the
prefill node's pool, which lives in a shared-memory segment (shm.py) that it mapped at the handshake.

The prefill node announces the room with its page ids and the segment's fence (kc.Announce.shm_pages)
and keeps the pages until the decode's Copied, for at most `transfer_timeout_s`; giving up on the room
first (timeout, shutdown) fences the segment, so that a copy still under way is refused. The decode
copies on its pair thread, checks the fence before and after, and answers every announcement with
Copied, the room failed or not. An abort (the prefill node's, or the decode's) therefore does not give
up on an announced room: it fails when its Copied comes, so that a fence bump does not fail the other
rooms' copies running at that moment (the timeout still bounds the wait).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.checksum import checked_indices, mismatch, page_hashes
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.layout import PoolGeometry, kv_head_ranges
from pdserve.kv_transfer.mailbox import Done, Mailbox, Started, ToSender
from pdserve.kv_transfer.receiver_pair import ReceiverPair
from pdserve.kv_transfer.send_hooks import SendHooks
from pdserve.kv_transfer.sender_pair import SenderPair
from pdserve.kv_transfer.shm import MappedPool, SharedSegment, ShmError, copy_heads
from pdserve.kv_transfer.state import RecvRoom, SendRoom, TransferState
from pdserve.kv_transfer.transport import ReceiveTransport, SendJob, SendTransport
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.kv_trailer import decode_trailer, encode_trailer

log = logging.getLogger("pdserve.kv_transfer")


class ShmSend(SendTransport):
    """The prefill node's side: announce the pages; the decode's Copied (or the timer) ends the room.
    `segments`: the pool's, or a TP worker's ranks' pools' (rank 0's first: its fence guards them all)."""

    def __init__(
        self,
        kv: torch.Tensor,
        segments: list[SharedSegment],
        geometry: PoolGeometry,
        config: TransferConfig,
        hooks: SendHooks,
    ) -> None:
        """`kv`: the pool in `segments[0]`; with one segment it holds every head, and its pages are hashed
        (checksum.py); a TP worker's ranks' pools are not (the decode copies their heads apart)."""
        self.segment, self._segments = segments[0], segments
        self._kv, self._geometry, self._config = kv, geometry, config
        self.started_timeout_s = config.transfer_timeout_s
        self._hooks = hooks

    def offer(self) -> kc.ShmOffer:
        """What HelloAck offers every decode peer: a decode node on this host maps it."""
        seg = self.segment
        ranks = [kc.ShmSegmentRef(path=s.path, token=s.token.hex()) for s in self._segments[1:]]
        return kc.ShmOffer(
            path=seg.path, token=seg.token.hex(), num_pages=self._geometry.num_pages, ranks=ranks
        )

    def transfer(self, pair: SenderPair, job: SendJob) -> None:
        """The fence is read before Started: any bump for this room comes after it."""
        fence = self.segment.fence
        mode = self._config.kv_checksum if len(self._segments) == 1 else "off"
        try:
            hashes = page_hashes(self._kv, job.src_pages, checked_indices(len(job.src_pages), mode))
        except (IndexError, RuntimeError):
            hashes = []  # pages outside the pool: the decode refuses the room before any copy
        pair.post(Started(job.room))
        self._hooks.before_data()
        job.flipped = self._hooks.corrupt(self._kv, job.src_pages)
        trailer = encode_trailer(job.room, job.num_tokens, job.metadata, hashes)
        pair.out(
            kc.Announce(
                room=job.room,
                seq=pair.next_seq(),
                gen=-1,
                num_pages=len(job.src_pages),
                chunk_pages=0,
                trailer_len=len(trailer),
                num_tokens=job.num_tokens,
                shm_pages=job.src_pages,
                shm_fence=fence,
                trailer=base64.b64encode(trailer).decode(),
            )
        )

    def give_up(self, room: SendRoom) -> str:
        """Fence first, so that a copy still under way is refused, then the pages may be freed."""
        self.segment.bump_fence()
        if room.job is not None:
            self._hooks.restore(self._kv, room.job.flipped)
        return f"timed out after {self.started_timeout_s}s waiting for the decode to copy the pages"

    def copied(self, room: SendRoom, msg: kc.Copied) -> Done | None:
        """The decode's Copied for `room` as the room's Done; None if the room is not waiting for it
        (given up already, and fenced)."""
        if room.state != TransferState.TRANSFERRING or room.transport is not self or room.job is None:
            return None
        self._hooks.restore(self._kv, room.job.flipped)
        if msg.error:
            return Done(room.room, msg.error, corrupt=msg.corrupt)
        return Done(room.room, None, len(room.job.src_pages) * self._geometry.page_bytes)


@dataclass
class ShmJob:
    """Copy a room's pages out of the prefill node's shared-memory segment."""

    room: str
    seq: int
    src_pages: list[int]  # the prefill node's: bounds-checked against its pool before any copy
    dst_pages: list[int]
    fence: int  # the segment's fence when the room was announced
    trailer: bytes


@dataclass
class RankPools:
    """A worker's KV pools by TP rank, with the KV heads each holds (TP 1: one pool of every head)."""

    pools: list[torch.Tensor]
    heads: list[range]


class ShmReceive(ReceiveTransport[ShmJob]):
    """The decode node's side for one prefill peer: its ranks' pools mapped (None: not mapped, every
    shared-memory announcement is refused). Each of this node's ranks' pools (`dst`) takes its KV heads
    straight from the prefill rank that holds them."""

    def __init__(
        self, addr: str, dst: RankPools, mailbox: Mailbox, src: tuple[MappedPool, RankPools] | None
    ) -> None:
        """`src`: map_segment's answer, the prefill's rank-0 segment (its fence) and every rank's pool."""
        self.src: MappedPool | None = None if src is None else src[0]
        self._src_ranks: RankPools | None = None if src is None else src[1]
        self._addr, self._dst, self._mailbox = addr, dst, mailbox

    def accept(self, live: RecvRoom | None, msg: kc.Announce) -> tuple[ShmJob | None, str | None]:
        """A room gone here, or a segment never mapped, is answered at once with a failed Copied."""
        error = ""
        if self.src is None:
            error = "shared-memory pages announced to a decode node that did not map the segment"
        elif live is None:
            error = f"room {msg.room} is gone on the decode node"
        elif msg.num_pages > len(live.pages):
            error = f"{msg.num_pages} pages announced for a page list of {len(live.pages)}"
        try:
            trailer = base64.b64decode(msg.trailer or "", validate=True)
        except (binascii.Error, ValueError):
            error = error or "unreadable shared-memory trailer"
        if error:
            self._mailbox.post(ToSender(self._addr, kc.Copied(room=msg.room, seq=msg.seq, error=error)))
            return None, error
        assert live is not None
        dst = live.pages[: msg.num_pages]
        return ShmJob(msg.room, msg.seq, msg.shm_pages or [], dst, msg.shm_fence, trailer), None

    def receive(self, pair: ReceiverPair, job: ShmJob) -> None:
        """Copy, then check the fence: pages the prefill node gave up on (and may have reused) during
        the copy are never committed. The prefill node learns the outcome from Copied either way."""
        assert self.src is not None  # accept() made no job otherwise
        error: str | None = None
        corrupt = False
        metadata = None
        nbytes = 0
        try:
            if self.src.fence != job.fence:
                raise RuntimeError("the prefill node gave up on the room before the copy")
            assert self._src_ranks is not None  # mapped with the pool
            src, dst = self._src_ranks, self._dst
            nbytes = copy_heads(src.pools, src.heads, job.src_pages, dst.pools, dst.heads, job.dst_pages)
            if self.src.fence != job.fence:
                raise RuntimeError("the prefill node gave up on the room during the copy")
            t = decode_trailer(job.trailer)
            if t.room != job.room:
                raise RuntimeError(f"room id mismatch: expected {job.room}, data is for {t.room}")
            metadata = t.metadata
            if len(dst.pools) == 1:  # a TP decode's ranks hold the heads apart: not hashed (checksum.py)
                error = mismatch(dst.pools[0], job.dst_pages, t.checksums)
                corrupt = error is not None
        except (RuntimeError, ValueError, ProtocolError) as exc:
            error = f"shared-memory copy failed: {exc}"
        pair.post(
            ToSender(self._addr, kc.Copied(room=job.room, seq=job.seq, error=error or "", corrupt=corrupt))
        )
        if error is not None:
            pair.post(Done(job.room, error, corrupt=corrupt))
        else:
            pair.post(Done(job.room, None, nbytes, metadata, shm=True))


def map_segment(
    addr: str,
    offer: kc.ShmOffer | None,
    tp_size: int,
    geometry: PoolGeometry,
    config: TransferConfig,
    logged: set[str],
) -> tuple[MappedPool, RankPools] | None:
    """The pools of the prefill node at `addr` (of TP `tp_size`: one per rank) mapped from shared
    memory: rank 0's (whose fence guards them all) and every rank's pool with its KV heads; or None,
    and its rooms use the pair group. `geometry`: the full-head pool's. `logged`: fall-back reasons
    logged already (transport "auto" logs each once)."""
    if offer is None or config.transport == "dist":
        return None
    try:
        heads = kv_head_ranges(geometry.kv_heads, tp_size)
        refs = [(offer.path, offer.token)] + [(r.path, r.token) for r in offer.ranks]
        if len(refs) != tp_size:
            raise ShmError(f"{len(refs)} segments offered for {tp_size} ranks")
        mapped = [
            MappedPool.open(
                path,
                bytes.fromhex(token),
                offer.num_pages,
                dataclasses.replace(geometry, kv_heads=len(h)),
                config.shm_dir,
            )
            for (path, token), h in zip(refs, heads)
        ]
        log.info("kv_transfer: prefill %s: KV through shared memory (%s)", addr, offer.path)
        return mapped[0], RankPools([m.pool for m in mapped], heads)
    except (ShmError, ValueError) as exc:
        reason = str(exc)
        if config.transport == "shm":
            log.warning("kv_transfer: prefill %s: no shared memory, using the pair group: %s", addr, reason)
        elif reason not in logged and len(logged) < 64:
            logged.add(reason)
            log.info("kv_transfer: prefill %s: no shared memory, using the pair group: %s", addr, reason)
        return None
