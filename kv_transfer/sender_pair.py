"""The prefill side of one pair: a control thread that runs the pair's rooms in order and owns its group.

Rooms of one pair are serialised on this thread (several may be queued), whichever their transport
(transport.py); the thread also builds the pair group, rebuilds it when it is dead or holds stray
connections, and reports to the sender's I/O thread through its mailbox (mailbox.py).
"""

from __future__ import annotations

import base64
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.mailbox import Done, Item, Mailbox, Outbound
from pdserve.kv_transfer.pair_group import MAX_STRAY_CONNECTIONS, SENDER_RANK, PairGroup
from pdserve.kv_transfer.pair_store import PairStores
from pdserve.kv_transfer.pair_thread import PairThread
from pdserve.kv_transfer.transport import SendJob
from pdserve.protocol import kv_control as kc

log = logging.getLogger("pdserve.kv_transfer")


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
        host: str,
        config: TransferConfig,
        mailbox: Mailbox,
        gens: Callable[[], int],
    ) -> None:
        self.identity = identity
        self.pair_id = identity.decode()
        self.last_used = self.created = time.monotonic()
        # The generation of the last group built (-1: none yet); written by the pair thread only.
        self.built_gen = -1
        self.inflight = 0  # jobs queued or running; I/O thread only
        # A generation the receiver reported dead; the thread drops its group if it matches (atomic write).
        self.discard_gen: int = -1
        self._kv, self._config, self._mailbox = kv, config, mailbox
        self._host = host
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

    # ---- for the transports, on this pair's thread -------------------------------------------------

    def out(self, msg: kc.Message) -> None:
        """Send `msg` to the decode peer (through the I/O thread, which owns the socket)."""
        self._mailbox.post(Outbound(self.identity, msg))

    def post(self, item: Item) -> None:
        self._mailbox.post(item)

    def next_seq(self) -> int:
        """A transfer number never used before on this pair (selects the tags of its data)."""
        return next(self._seq)

    def live_group(self) -> PairGroup | str:
        """The group to transfer on: the current one, or a new generation where the receiver reported
        it dead, its gloo port holds stray connections, or there is none; why not if the build failed."""
        if self._group is not None and self._group.gen == self.discard_gen:
            self.drop_group()
        if self._group is not None and (strays := self._group.stray_connections()) > MAX_STRAY_CONNECTIONS:
            # Connections that are not the peer's, which gloo never closes: only a new group sheds them.
            log.warning(
                "kv_transfer: pair gen %d's gloo port holds %d stray connections: rebuilding the group",
                self._group.gen,
                strays,
            )
            self.drop_group()
        if self._group is None:
            gen = self.new_gen()
            self.out(kc.Build(gen=gen))
            error = self._build(gen)
            if error is not None:
                return error
        assert self._group is not None
        return self._group

    def drop_group(self) -> None:
        """Close the current group (a timeout or a peer failure killed it); the next transfer builds anew."""
        if self._group is not None:
            self._group.close()
            self._group = None

    # ---- the thread ---------------------------------------------------------------------------------

    def _publish(self, gen: int, key: str, value: bytes) -> None:
        self.out(kc.StoreSet(gen=gen, key=key, value=base64.b64encode(value).decode()))

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
        elif job.cancelled.is_set():
            self.post(Done(job.room, "aborted before the transfer started"))
        else:
            job.transport.transfer(self, job)

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
        self.drop_group()
        gen = self.new_gen()
        self.out(kc.Build(gen=gen))
        self._build(gen)
