"""What the two ends of the hand-off share: the caller-facing result queue and the I/O thread's life.

`KVSender` and `KVReceiver` both let the caller's thread only post to a mailbox or read a deque; one
I/O thread owns all room state, writes `_states` and appends to `_results`. Nothing a peer sends may
end that thread; should it end anyway, `io_failure` says so (the worker's health port reports it).

An endpoint lifts the process's soft limit on open files to the hard one: its pair groups' gloo listeners
accept every connection, and gloo aborts the process when `accept` fails for want of a descriptor.
"""

from __future__ import annotations

import collections
import logging
import resource
import threading
from collections.abc import Callable
from typing import Any

import zmq
import zmq.auth.base

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.handshake import pair_identity
from pdserve.kv_transfer.io_loop import EndpointIO
from pdserve.kv_transfer.layout import geometry_of, kv_head_ranges, pool_tensor
from pdserve.kv_transfer.mailbox import Close, Mailbox
from pdserve.kv_transfer.state import TransferResult, TransferState
from pdserve.side_threads import serial_openmp


def raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard one; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logging.getLogger("pdserve.kv_transfer").warning(
                "kv_transfer: could not raise the open-files limit from %d: %s", soft, e
            )
    return soft


class Endpoint:
    def __init__(
        self, kv: Any, fingerprint: dict[str, str | int], config: TransferConfig, tp_size: int = 1
    ) -> None:
        """`kv`: the pool every KV head of a page is in, as the wire carries it (a TP worker's rank 0:
        its full-head transfer pool); `tp_size`: how many ranks' pools hold those heads
        (layout.kv_head_ranges), which the handshake tells the peer."""
        raise_open_files_limit()
        self._kv = pool_tensor(kv)
        self._geometry = geometry_of(self._kv)
        self._tp_size = tp_size
        self._head_split = kv_head_ranges(self._geometry.kv_heads, tp_size)
        self._identity = pair_identity(fingerprint, self._geometry, config.backend)
        self._config = config
        self._mailbox = Mailbox()
        self._results: collections.deque[TransferResult] = collections.deque()
        self._states: dict[str, TransferState] = {}  # written by the I/O thread only
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._auth: zmq.auth.base.Authenticator | None = None  # ZAP handler of a keyed bootstrap server
        self._io_error: str | None = None  # why the I/O thread ended, if it did before close()
        # Called on the I/O thread after each result is queued (the worker wakes its loop): set before start().
        self.on_result: Callable[[], None] | None = None

    def _publish(self, result: TransferResult) -> None:
        """(I/O thread) Queue a finished room's result for poll(), and say so."""
        self._results.append(result)
        if self.on_result is not None:
            self.on_result()

    def poll(self) -> list[TransferResult]:
        """Rooms finished (SUCCESS or FAILED) since the last poll; their pages may be freed now."""
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def state(self, room: str) -> TransferState | None:
        return self._states.get(room)

    def io_failure(self) -> str | None:
        """None while the I/O thread runs (or before start / after close); else why it stopped."""
        if self._thread is not None and not self._thread.is_alive():
            return f"the KV transfer I/O thread stopped: {self._io_error or 'exited'}"
        return None

    def _run_io(self, io: EndpointIO[Any]) -> None:
        """The I/O thread's body: `io.run()` until Close; an escape is recorded, never silent."""
        try:
            serial_openmp()  # no second OpenMP team beside the forward's (pdserve/side_threads.py)
            io.run()
        except BaseException as e:  # noqa: BLE001 - recorded for io_failure, then the thread ends
            self._io_error = f"{type(e).__name__}: {e}"
            logging.getLogger("pdserve.kv_transfer").exception("kv_transfer: the I/O thread died")
        finally:
            io.shutdown()

    def close(self) -> None:
        """Stop the I/O thread (it closes the pairs), then the zmq context and the mailbox."""
        if self._thread is not None:
            self._mailbox.post(Close())
            self._thread.join(timeout=5)
            self._thread = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        self._mailbox.close()
