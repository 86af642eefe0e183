"""KVReceiver: the decode node's end of the KV hand-off.

Threads: the caller's (request/abort/poll never block; connect() does, by design, at registration), one
I/O thread that owns all room state and one pyzmq DEALER per prefill node, and one control thread per
pair (ReceiverPair, receiver_pair.py) that builds the pair group and receives in the order the prefill node announces.

Pages given to request() belong to the transfer until poll() reports the room: on SUCCESS they hold the
prompt's KV (committed after the trailer's room id matched); on FAILED free them.

The rooms and peers live on the I/O thread (receiver_io.py); their pages come through this node's
mapping of a same-host prefill node's shared-memory segment (shm_transport.py), else over the pair
group (dist_transport.py).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from typing import Any

import torch
import zmq

from pdserve.kv_transfer import mailbox as mb
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.endpoint import Endpoint
from pdserve.kv_transfer.receiver_io import ReceiverIO


class KVReceiver(Endpoint):
    """Receives prompts' KV pages from prefill nodes into pre-allocated pages of the local pool."""

    def __init__(
        self,
        kv: Any,
        fingerprint: dict[str, str | int],
        config: TransferConfig,
        *,
        tp_size: int = 1,
        rank_pools: list[torch.Tensor] | None = None,
    ) -> None:
        """`kv`: the pool the pair group fills (a TP worker's rank 0: its full-head transfer pool).
        `rank_pools`: a TP worker's ranks' own pools (rank 0's, then the others' as rank 0 maps them),
        into which a same-host prefill's heads are copied straight; None: `kv` (TP 1), or a TP worker
        whose rooms all arrive in `kv`."""
        super().__init__(kv, fingerprint, config, tp_size)
        if rank_pools is not None and len(rank_pools) != tp_size:
            raise ValueError(f"{len(rank_pools)} rank pools for {tp_size} ranks")
        self._rank_pools = rank_pools
        self.receiver_id = uuid.uuid4().hex  # zmq identity and pair id; unique per process lifetime

    def start(self) -> None:
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._io_loop, name="kv-receiver-io", daemon=True)
        self._thread.start()

    def connect(self, prefill_addr: str, timeout_s: float | None = None) -> None:
        """Handshake with a prefill node now (blocking). Raises FingerprintMismatch if the pair is refused,
        TimeoutError if the node does not answer within bootstrap_timeout_s (or timeout_s)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._mailbox.post(mb.Connect(prefill_addr, future))
        future.result(timeout=timeout_s if timeout_s is not None else self._config.bootstrap_timeout_s + 5)

    def request(
        self,
        room: str,
        prefill_addr: str,
        dst_pages: list[int],
        num_tokens: int,
        skip_pages: int = 0,
        prefix_hash: int | None = None,
    ) -> None:
        """Ask the prefill node at prefill_addr to fill dst_pages with room's KV (num_tokens tokens).

        Incremental transfer: with `skip_pages`, this node holds the KV of the room's first
        `skip_pages` whole pages already (`prefix_hash`: the chained block hash of the last), and
        `dst_pages` are for the pages after them. If the prefill node's prompt starts otherwise,
        poll() reports FAILED with `prefix_mismatch` set: request the room again, in full."""
        if skip_pages and prefix_hash is None:
            raise ValueError("skipping pages needs the prefix hash")
        self._mailbox.post(
            mb.Request(
                room,
                prefill_addr,
                list(dst_pages),
                int(num_tokens),
                time.monotonic(),
                skip_pages=int(skip_pages),
                prefix_hash=prefix_hash,
            )
        )

    def abort(self, room: str) -> None:
        """Give up on `room`; its FAILED result still comes out of poll() (free the pages then)."""
        self._mailbox.post(mb.Abort(room, "aborted by decode"))

    def _io_loop(self) -> None:
        self._run_io(ReceiverIO(self))
