"""The decode side of one pair: a control thread that runs the pair's rooms in announced order and
owns its group.

Jobs arrive in the order the prefill node announced them (one zmq connection keeps order), so both ends
of the pair group post matching operations; each runs on its transport (transport.py). The thread
reports to the receiver's I/O thread through its mailbox (mailbox.py): Done and GroupDead.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.io_loop import local_address_towards
from pdserve.kv_transfer.mailbox import GroupDead, Item, Mailbox, ToSender
from pdserve.kv_transfer.pair_group import MAX_STRAY_CONNECTIONS, RECEIVER_RANK, PairGroup
from pdserve.kv_transfer.pair_store import PairStores
from pdserve.kv_transfer.pair_thread import PairThread
from pdserve.protocol import kv_control as kc

if TYPE_CHECKING:
    from pdserve.kv_transfer.transport import ReceiveTransport

J = TypeVar("J")


@dataclass
class _Build:
    gen: int
    pair_id: str


class ReceiverPair(PairThread[Callable[[], None] | _Build]):
    """One prefill peer as seen from the decode node: a job queue served by one thread."""

    def __init__(
        self,
        *,
        addr: str,
        peer_host: str,
        kv: torch.Tensor,
        config: TransferConfig,
        mailbox: Mailbox,
    ) -> None:
        self.addr = addr
        self._peer_host = peer_host
        self._kv, self._config, self._mailbox = kv, config, mailbox
        # The rendezvous keys of this pair's groups travel on the bootstrap channel (pair_store.py).
        self.stores = PairStores(self._publish, timedelta(seconds=config.bootstrap_timeout_s))
        self._reported_gen = -1  # the last group reported dead for stray connections (pair thread only)
        self._start(f"kv-recv-pair-{addr}")

    def build(self, gen: int, pair_id: str) -> None:
        self._jobs.put(_Build(gen, pair_id))

    def submit(self, transport: ReceiveTransport[J], job: J) -> None:
        """Queue `job` for `transport.receive`, after the jobs announced before it."""
        self._jobs.put(lambda: transport.receive(self, job))

    # ---- for the transports, on this pair's thread -------------------------------------------------

    @property
    def group(self) -> PairGroup | None:
        return self._group

    def drop_group(self) -> None:
        """Close the current group (a timeout or a peer failure killed it); the sender builds anew."""
        if self._group is not None:
            self._group.close()
            self._group = None

    def post(self, item: Item) -> None:
        self._mailbox.post(item)

    # ---- the thread ---------------------------------------------------------------------------------

    def _publish(self, gen: int, key: str, value: bytes) -> None:
        msg = kc.StoreSet(gen=gen, key=key, value=base64.b64encode(value).decode())
        self._mailbox.post(ToSender(self.addr, msg))

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

    def _handle(self, job: Callable[[], None] | _Build) -> None:
        if isinstance(job, _Build):
            self._build(job)
        else:
            job()

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
