"""The prefill side of one pair: a control thread that owns the pair group and runs its transfers in order.

Transfers of one pair are serialised on this thread (several may be queued). The thread reports to the
sender's I/O thread through its mailbox (mailbox.py): Outbound to send a control message, Started, Done.
"""

from __future__ import annotations

import base64
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.layout import PoolGeometry, chunk_pages, direct_runs
from pdserve.kv_transfer.mailbox import Done, Mailbox, Outbound, Started
from pdserve.kv_transfer.pair_group import MAX_STRAY_CONNECTIONS, SENDER_RANK, PairThread
from pdserve.kv_transfer.pair_store import PairStores
from pdserve.kv_transfer.shm import SharedSegment
from pdserve.protocol import kv_control as kc
from pdserve.protocol.kv_trailer import FirstToken, encode_trailer

log = logging.getLogger("pdserve.kv_transfer")


@dataclass
class SendJob:
    room: str
    src_pages: list[int]  # exactly the pages that travel
    dst_pages: list[int]  # where they land on the decode node, same length
    num_tokens: int
    metadata: FirstToken
    shm: bool = False  # the decode copies the pages out of this node's shared-memory segment
    # Set by the I/O thread on abort; checked before the transfer starts.
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Build:
    gen: int


class SenderPair(PairThread[SendJob | _Build]):
    """One decode peer as seen from the prefill node: a job queue served by one thread."""

    def __init__(
        self,
        *,
        identity: bytes,
        kv: torch.Tensor,
        geometry: PoolGeometry,
        host: str,
        config: TransferConfig,
        mailbox: Mailbox,
        gens: Callable[[], int],
        segment: SharedSegment | None = None,
    ) -> None:
        self.identity = identity
        self.pair_id = identity.decode()
        self.last_used = self.created = time.monotonic()
        # The generation of the last group built (-1: none yet); written by the pair thread only.
        self.built_gen = -1
        self.inflight = 0  # jobs queued or running; I/O thread only
        # A generation the receiver reported dead; the thread drops its group if it matches (atomic write).
        self.discard_gen: int = -1
        self._kv, self._geometry, self._config, self._mailbox = kv, geometry, config, mailbox
        self._host = host
        self._segment = segment
        # The rendezvous keys of this pair's groups travel on the bootstrap channel (pair_store.py).
        self.stores = PairStores(self._publish, timedelta(seconds=config.bootstrap_timeout_s))
        # Generations come from one counter per sender, so a pair re-created for the same decode node
        # never reuses a store prefix whose keys still hold a dead group's addresses.
        self.new_gen = gens
        self._seq = itertools.count()
        self._start(f"kv-send-pair-{self.pair_id[:8]}")

    def build(self, gen: int) -> None:
        """Queue building generation `gen` (the receiver was told the same gen in HELLO_ACK)."""
        self._jobs.put(_Build(gen))

    def submit(self, job: SendJob) -> None:
        self.inflight += 1
        self.last_used = time.monotonic()
        self._jobs.put(job)

    def _out(self, msg: kc.Message) -> None:
        self._mailbox.post(Outbound(self.identity, msg))

    def _publish(self, gen: int, key: str, value: bytes) -> None:
        self._out(kc.StoreSet(gen=gen, key=key, value=base64.b64encode(value).decode()))

    def _build(self, gen: int) -> str | None:
        try:
            self._replace_group(
                store=self.stores.for_gen(gen),
                pair_id=self.pair_id,
                gen=gen,
                rank=SENDER_RANK,
                local_host=self._host,
            )
            self.built_gen = gen
            return None
        except Exception as exc:  # noqa: BLE001 - any build failure means "no group", reported upward
            return f"building pair group gen {gen} failed: {exc}"

    def _handle(self, job: SendJob | _Build) -> None:
        if isinstance(job, _Build):
            self._build(job.gen)
        else:
            self._transfer(job)

    def _shed_strays(self) -> None:
        """Rebuild a group whose gloo port holds stray connections, on this side or (reported dead by
        the receiver) on the other, between jobs: a pair used only through shared memory has no gloo
        transfer that would."""
        group = self._group
        if group is None:
            return
        strays = group.stray_connections()
        if group.gen != self.discard_gen and strays <= MAX_STRAY_CONNECTIONS:
            return
        log.warning(
            "kv_transfer: rebuilding pair gen %d (%s)",
            group.gen,
            f"{strays} stray connections on its gloo port"
            if strays > MAX_STRAY_CONNECTIONS
            else "receiver's report",
        )
        group.close()
        self._group = None
        gen = self.new_gen()
        self._out(kc.Build(gen=gen))
        self._build(gen)

    def _announce_shm(self, job: SendJob) -> None:
        """Same host: announce the pages for the decode to copy; its Copied (to the I/O thread) ends
        the room. The fence is read before Started: any bump for this room comes after it."""
        assert self._segment is not None
        fence = self._segment.fence
        self._mailbox.post(Started(job.room, shm=True))
        if self._config.stall_data_s > 0:
            time.sleep(self._config.stall_data_s)  # test hook: the sender's copy timeout must fire
        trailer = encode_trailer(job.room, job.num_tokens, job.metadata)
        self._out(
            kc.Announce(
                room=job.room,
                seq=next(self._seq),
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

    def _transfer(self, job: SendJob) -> None:
        if job.cancelled.is_set():
            self._mailbox.post(Done(job.room, "aborted before the transfer started"))
            return
        if job.shm:
            self._announce_shm(job)
            return
        if self._group is not None and self._group.gen == self.discard_gen:
            self._group.close()
            self._group = None
        if self._group is not None and (strays := self._group.stray_connections()) > MAX_STRAY_CONNECTIONS:
            # Connections that are not the peer's, which gloo never closes: only a new group sheds them.
            log.warning(
                "kv_transfer: pair gen %d's gloo port holds %d stray connections: rebuilding the group",
                self._group.gen,
                strays,
            )
            self._group.close()
            self._group = None
        if self._group is None:
            gen = self.new_gen()
            self._out(kc.Build(gen=gen))
            error = self._build(gen)
            if error is not None:
                self._mailbox.post(Done(job.room, error))
                return
        group = self._group
        assert group is not None
        self._mailbox.post(Started(job.room))
        seq = next(self._seq)
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
        trailer = encode_trailer(job.room, job.num_tokens, job.metadata)
        self._out(
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
        if self._config.stall_data_s > 0:
            time.sleep(self._config.stall_data_s)  # test hook: the receiver's per-operation timeout must fire
        try:
            if runs is not None:
                num_bytes = group.send_direct(self._kv, job.src_pages, runs, seq, trailer)
            else:
                num_bytes = group.send_pages(self._kv, self._geometry, job.src_pages, per_chunk, seq, trailer)
        except Exception as exc:  # noqa: BLE001 - timeout or peer failure: this generation is dead
            group.close()
            self._group = None
            self._mailbox.post(Done(job.room, f"sending KV failed (pair gen {group.gen} discarded): {exc}"))
            return
        self._mailbox.post(Done(job.room, None, num_bytes))
