"""The decode side of one pair: a control thread that owns the pair group and receives in announced order.

Jobs arrive in the order the prefill node announced them (one zmq connection keeps order), so both ends
of the pair group post matching operations. The thread reports to the receiver's I/O thread through
its mailbox (mailbox.py): Done (with the trailer's metadata on success) and GroupDead.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import timedelta

import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.io_loop import local_address_towards
from pdserve.kv_transfer.layout import PoolGeometry
from pdserve.kv_transfer.mailbox import Done, GroupDead, Mailbox, ToSender
from pdserve.kv_transfer.pair_group import MAX_STRAY_CONNECTIONS, RECEIVER_RANK, PairThread
from pdserve.kv_transfer.pair_store import PairStores
from pdserve.kv_transfer.shm import MappedPool, copy_pages
from pdserve.protocol import kv_control as kc
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.kv_trailer import decode_trailer


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


@dataclass
class ShmJob:
    """Copy a room's pages out of the prefill node's shared-memory segment (shm.py)."""

    room: str
    seq: int
    src: MappedPool
    src_pages: list[int]  # the prefill node's: bounds-checked against its pool before any copy
    dst_pages: list[int]
    fence: int  # the segment's fence when the room was announced
    trailer: bytes


@dataclass
class _Build:
    gen: int
    pair_id: str


class ReceiverPair(PairThread[RecvJob | ShmJob | _Build]):
    """One prefill peer as seen from the decode node: a job queue served by one thread."""

    def __init__(
        self,
        *,
        addr: str,
        peer_host: str,
        kv: torch.Tensor,
        geometry: PoolGeometry,
        config: TransferConfig,
        mailbox: Mailbox,
    ) -> None:
        self.addr = addr
        self._peer_host = peer_host
        self._kv, self._geometry, self._config, self._mailbox = kv, geometry, config, mailbox
        # The rendezvous keys of this pair's groups travel on the bootstrap channel (pair_store.py).
        self.stores = PairStores(self._publish, timedelta(seconds=config.bootstrap_timeout_s))
        self._reported_gen = -1  # the last group reported dead for stray connections (pair thread only)
        self._start(f"kv-recv-pair-{addr}")

    def build(self, gen: int, pair_id: str) -> None:
        self._jobs.put(_Build(gen, pair_id))

    def _publish(self, gen: int, key: str, value: bytes) -> None:
        msg = kc.StoreSet(gen=gen, key=key, value=base64.b64encode(value).decode())
        self._mailbox.post(ToSender(self.addr, msg))

    def submit(self, job: RecvJob | ShmJob) -> None:
        self._jobs.put(job)

    def _shed_strays(self) -> None:
        """A group whose gloo port holds stray connections is reported dead once, between jobs: the
        sender then builds a new one, and replacing this one closes its listener with them."""
        group = self._group
        if group is None or group.gen == self._reported_gen:
            return
        if (strays := group.stray_connections()) > MAX_STRAY_CONNECTIONS:
            self._reported_gen = group.gen
            reason = f"its gloo port holds {strays} stray connections"
            self._mailbox.post(GroupDead(self.addr, group.gen, reason))

    def _handle(self, job: RecvJob | ShmJob | _Build) -> None:
        if isinstance(job, _Build):
            self._build(job)
        elif isinstance(job, ShmJob):
            self._copy(job)
        else:
            self._receive(job)

    def _build(self, job: _Build) -> None:
        try:
            self._replace_group(
                store=self.stores.for_gen(job.gen),
                pair_id=job.pair_id,
                gen=job.gen,
                rank=RECEIVER_RANK,
                local_host=local_address_towards(self._peer_host),
            )
        except Exception as exc:  # noqa: BLE001 - the sender sees its own build fail and rebuilds
            self._mailbox.post(
                GroupDead(self.addr, job.gen, f"building pair group gen {job.gen} failed: {exc}")
            )

    def _copy(self, job: ShmJob) -> None:
        """Copy, then check the fence: pages the prefill node gave up on (and may have reused) during
        the copy are never committed. The prefill node learns the outcome from Copied either way."""
        error: str | None = None
        metadata = None
        nbytes = 0
        try:
            if job.src.fence != job.fence:
                raise RuntimeError("the prefill node gave up on the room before the copy")
            nbytes = copy_pages(job.src.pool, job.src_pages, self._kv, job.dst_pages)
            if job.src.fence != job.fence:
                raise RuntimeError("the prefill node gave up on the room during the copy")
            room, _num_tokens, metadata = decode_trailer(job.trailer)
            if room != job.room:
                raise RuntimeError(f"room id mismatch: expected {job.room}, data is for {room}")
        except (RuntimeError, ValueError, ProtocolError) as exc:
            error = f"shared-memory copy failed: {exc}"
        self._mailbox.post(ToSender(self.addr, kc.Copied(room=job.room, seq=job.seq, error=error or "")))
        if error is not None:
            self._mailbox.post(Done(job.room, error))
        else:
            self._mailbox.post(Done(job.room, None, nbytes, metadata, shm=True))

    def _receive(self, job: RecvJob) -> None:
        group = self._group
        if group is None or group.gen != job.gen:
            live = None if group is None else group.gen
            self._mailbox.post(Done(job.room, f"pair group gen {job.gen} is not live here (live: {live})"))
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
            group.close()
            self._group = None
            reason = f"receiving KV failed (pair gen {job.gen} discarded): {exc}"
            self._mailbox.post(GroupDead(self.addr, job.gen, reason))
            self._mailbox.post(Done(job.room, reason))
            return
        try:
            room, _num_tokens, metadata = decode_trailer(trailer)
        except ProtocolError as exc:
            self._mailbox.post(Done(job.room, f"unreadable transfer trailer: {exc}"))
            return
        if room != job.room:
            self._mailbox.post(Done(job.room, f"room id mismatch: expected {job.room}, data is for {room}"))
            return
        nbytes = job.num_pages * self._geometry.page_bytes
        self._mailbox.post(Done(job.room, None, nbytes, metadata, direct=job.runs is not None))
        if (strays := group.stray_connections()) > MAX_STRAY_CONNECTIONS:
            # gloo never closes connections that are not the peer's: the sender builds a new group, and
            # replacing this one here (its Build) closes its listener with them.
            reason = f"its gloo port holds {strays} stray connections"
            self._mailbox.post(GroupDead(self.addr, job.gen, reason))
