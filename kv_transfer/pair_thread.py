"""One pair's control thread: the pair's jobs in order, and the one owner of its group (pair_group.py).

The sender's and the receiver's pairs (sender_pair.py, receiver_pair.py) run on it; every STRAY_CHECK_S
between jobs it lets them shed stray connections from the group's gloo port.
"""

from __future__ import annotations

import base64
import queue
import threading
import time
from typing import Generic, TypeVar

import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.pair_group import STRAY_CHECK_S, PairGroup
from pdserve.kv_transfer.pair_store import PairStore, PairStores
from pdserve.protocol import kv_control as kc
from pdserve.side_threads import serial_openmp

_NO_JOB = object()  # the job queue's wait ended at a check's time

J = TypeVar("J")


class PairThread(Generic[J]):
    """One pair's control thread: a job queue served in order; `None` stops it after the current job.

    Subclasses set `_kv`, `_config` and `stores`, call `_start(name)` at the end of __init__ and implement
    `_handle(job)`. The thread owns `_group`: only it builds, uses and closes the pair group.
    """

    _kv: torch.Tensor
    _config: TransferConfig
    stores: PairStores  # the rendezvous keys of the pair's groups (pair_store.py)

    def _start(self, name: str) -> None:
        self._group: PairGroup | None = None
        self._jobs: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        serial_openmp()  # its page copies must not start a second OpenMP team (pdserve/side_threads.py)
        next_check = time.monotonic() + STRAY_CHECK_S
        while True:
            try:
                job: J | None | object = self._jobs.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:
                job = _NO_JOB
            if job is None:
                break
            if job is not _NO_JOB:
                self._handle(job)  # type: ignore[arg-type]  # a J: neither None nor _NO_JOB
            if time.monotonic() >= next_check:
                self._shed_strays()
                next_check = time.monotonic() + STRAY_CHECK_S
        if self._group is not None:
            self._group.close()

    def _handle(self, job: J) -> None:
        raise NotImplementedError

    def _shed_strays(self) -> None:
        """Every STRAY_CHECK_S, between jobs: a pair whose transfers all go through shared memory (or
        that is not used) has no gloo transfer that would shed stray connections on its group's port
        (see `stray_connections`), so this does."""

    def _replace_group(self, *, store: PairStore, pair_id: str, gen: int, rank: int, local_host: str) -> None:
        """Close the current group, if any, and build a new one; raises what the build raises."""
        if self._group is not None:
            self._group.close()
            self._group = None
        self._group = PairGroup(
            store=store,
            pair_id=pair_id,
            gen=gen,
            rank=rank,
            local_host=local_host,
            kv=self._kv,
            config=self._config,
        )

    def deliver(self, msg: kc.StoreSet) -> None:
        """(I/O thread) A key the peer set in one of the pair's rendezvous stores."""
        self.stores.deliver(msg.gen, msg.key, base64.b64decode(msg.value, validate=True))

    def close(self) -> None:
        """Stop after the current job; the group is dropped on the pair's own thread."""
        self._jobs.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
