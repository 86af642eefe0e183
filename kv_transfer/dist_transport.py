"""The KV transport over a pair's torch.distributed group (pair_group.py): between hosts, and wherever
shared memory is not used.

The sender announces each room (kc.Announce: staged chunks, or pool-to-pool runs where both page lists
run consecutively long enough), then sends its pages and the trailer on the group; the receiver posts
the matching operations in announced order and commits the pages only if the trailer names the room.
A group that saw a timeout or a peer failure is dropped on both sides; the next transfer builds anew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.checksum import checked_indices, mismatch, page_hashes
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.layout import PoolGeometry, chunk_pages, direct_runs, runs_fit
from pdserve.kv_transfer.mailbox import Done, GroupDead, Started
from pdserve.kv_transfer.pair_group import MAX_STRAY_CONNECTIONS
from pdserve.kv_transfer.receiver_pair import ReceiverPair
from pdserve.kv_transfer.send_hooks import SendHooks
from pdserve.kv_transfer.sender_pair import SenderPair
from pdserve.kv_transfer.state import RecvRoom
from pdserve.kv_transfer.transport import ReceiveTransport, SendJob, SendTransport
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.kv_trailer import decode_trailer, encode_trailer


class DistSend(SendTransport):
    """The prefill node's side: a room's pages from the pool onto the pair group."""

    def __init__(
        self,
        kv: torch.Tensor,
        geometry: PoolGeometry,
        config: TransferConfig,
        hooks: SendHooks,
        prepare: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`prepare(pages)`: fills those pages of `kv` before they are sent (a TP worker's rank 0
        gathers its ranks' heads into its full-head pool)."""
        self._kv, self._geometry, self._config, self._prepare = kv, geometry, config, prepare
        self._hooks = hooks

    def transfer(self, pair: SenderPair, job: SendJob) -> None:
        group = pair.live_group()
        if isinstance(group, str):
            pair.post(Done(job.room, group))
            return
        if self._prepare is not None:
            try:
                self._prepare(job.src_pages)
            except Exception as exc:  # noqa: BLE001 - this room fails, the pair goes on
                pair.post(Done(job.room, f"gathering the KV heads of the ranks failed: {exc}"))
                return
        try:
            checked = checked_indices(len(job.src_pages), self._config.kv_checksum)
            hashes = page_hashes(self._kv, job.src_pages, checked)
        except (IndexError, RuntimeError) as exc:  # pages outside the pool: this room fails, the pair goes on
            pair.post(Done(job.room, f"hashing the KV pages failed: {exc}"))
            return
        pair.post(Started(job.room))  # after the hashes: what changes from here on is caught
        seq = pair.next_seq()
        per_chunk = chunk_pages(self._geometry, len(job.src_pages), self._config.chunk_bytes)
        runs = None
        if group.can_send_direct:
            runs = direct_runs(
                job.src_pages,
                job.dst_pages,
                per_chunk,
                self._config.direct_min_bytes,
                self._geometry.page_bytes,
            )
        trailer = encode_trailer(job.room, job.num_tokens, job.metadata, hashes)
        flipped = self._hooks.corrupt(self._kv, job.src_pages)
        pair.out(
            kc.Announce(
                room=job.room,
                seq=seq,
                gen=group.gen,
                num_pages=len(job.src_pages),
                chunk_pages=per_chunk,
                runs=runs,
                trailer_len=len(trailer),
                num_tokens=job.num_tokens,
            )
        )
        self._hooks.before_data()
        try:
            if runs is not None:
                num_bytes = group.send_direct(self._kv, job.src_pages, runs, seq, trailer)
            else:
                num_bytes = group.send_pages(self._kv, self._geometry, job.src_pages, per_chunk, seq, trailer)
        except Exception as exc:  # noqa: BLE001 - timeout or peer failure: this generation is dead
            pair.drop_group()
            pair.post(Done(job.room, f"sending KV failed (pair gen {group.gen} discarded): {exc}"))
            return
        finally:
            self._hooks.restore(self._kv, flipped)
        pair.post(Done(job.room, None, num_bytes))


@dataclass
class RecvJob:
    room: str
    dst_pages: list[int] | None  # None: the room is gone here; drain the data to keep the pair in step
    num_pages: int
    chunk_pages: int
    runs: list[int] | None  # pool-to-pool pieces (layout.direct_runs), or None for staged chunks
    seq: int
    gen: int
    trailer_len: int


class DistReceive(ReceiveTransport[RecvJob]):
    """The decode node's side: a room's pages off the pair group into the pool."""

    def __init__(self, kv: torch.Tensor, geometry: PoolGeometry) -> None:
        self._kv, self._geometry = kv, geometry

    def accept(self, live: RecvRoom | None, msg: kc.Announce) -> tuple[RecvJob | None, str | None]:
        """Every announcement is received, into the room's pages or (no room) drained: the pair's two
        ends must post the same operations."""
        error = None
        if live is not None and msg.runs is not None and not runs_fit(live.pages[: msg.num_pages], msg.runs):
            # Never receive in place into pages outside a run: drain the data, fail the room.
            error = "the prefill node announced page runs that do not match this node's page list"
        job = RecvJob(
            room=msg.room,
            dst_pages=live.pages[: msg.num_pages] if live is not None and error is None else None,
            num_pages=msg.num_pages,
            chunk_pages=msg.chunk_pages,
            runs=msg.runs,
            seq=msg.seq,
            gen=msg.gen,
            trailer_len=msg.trailer_len,
        )
        return job, error

    def receive(self, pair: ReceiverPair, job: RecvJob) -> None:
        group = pair.group
        if group is None or group.gen != job.gen:
            live = None if group is None else group.gen
            pair.post(Done(job.room, f"pair group gen {job.gen} is not live here (live: {live})"))
            return
        try:
            if job.runs is not None:
                trailer = group.recv_direct(self._kv, job.dst_pages, job.runs, job.seq, job.trailer_len)
            else:
                trailer = group.recv_pages(
                    self._kv,
                    self._geometry,
                    job.dst_pages,
                    job.num_pages,
                    job.chunk_pages,
                    job.seq,
                    job.trailer_len,
                )
        except Exception as exc:  # noqa: BLE001 - timeout or peer failure: this generation is dead
            pair.drop_group()
            reason = f"receiving KV failed (pair gen {job.gen} discarded): {exc}"
            pair.post(GroupDead(pair.addr, job.gen, reason))
            pair.post(Done(job.room, reason))
            return
        try:
            t = decode_trailer(trailer)
        except ProtocolError as exc:
            pair.post(Done(job.room, f"unreadable transfer trailer: {exc}"))
            return
        if t.room != job.room:
            pair.post(Done(job.room, f"room id mismatch: expected {job.room}, data is for {t.room}"))
            return
        # A drained room (no pages here) is gone already: its Done is dropped.
        corrupt = None if job.dst_pages is None else mismatch(self._kv, job.dst_pages, t.checksums)
        if corrupt is not None:
            pair.post(Done(job.room, corrupt, corrupt=True))
            return
        nbytes = job.num_pages * self._geometry.page_bytes
        pair.post(Done(job.room, None, nbytes, t.metadata, direct=job.runs is not None))
        if (strays := group.stray_connections()) > MAX_STRAY_CONNECTIONS:
            # gloo never closes connections that are not the peer's: the sender builds a new group, and
            # replacing this one here (its Build) closes its listener with them.
            pair.post(GroupDead(pair.addr, job.gen, f"its gloo port holds {strays} stray connections"))
