"""KVSender: the prefill node's end of the KV hand-off.

Threads: the caller's (send/abort/poll only post to a mailbox or read a deque, never block), one I/O
thread that owns all room state and the pyzmq ROUTER bootstrap socket, and one control thread per pair
(SenderPair, sender_pair.py) that builds the pair's process group and runs its transfers in order.

Pages given to send() stay in use until poll() reports the room (SUCCESS or FAILED); free them then,
not before. The rooms and pairs live on the I/O thread (sender_io.py); their pages travel through the
decode's mapping of this node's shared-memory segment on the same host (shm_transport.py), else over
the pair group (dist_transport.py).

Exposure: with cluster keys (TransferConfig.keys) the bootstrap ROUTER runs CurveZMQ behind a ZAP
handler, so only holders of the cluster secret reach it; nothing is allocated for anyone else. Every
limit below holds with or without keys: a frame is at most `max_frame_bytes`; a peer's early page
lists (rooms not sent yet) are capped in number and pages, the oldest refused; a pair whose group was
never built (a handshake the peer never completed) is closed after twice `bootstrap_timeout_s`, and idle
pairs are evicted beyond `max_pairs`, unbuilt ones first. The pair groups meet through keys carried
on this same channel (pair_store.py): no store port is opened.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pdserve.cluster_auth import secure_server, start_authenticator
from pdserve.kv_transfer import mailbox as mb
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.endpoint import Endpoint
from pdserve.kv_transfer.send_hooks import SendHooks
from pdserve.kv_transfer.sender_io import SenderIO
from pdserve.kv_transfer.shm import SharedSegment
from pdserve.protocol.kv_trailer import FirstToken


class KVSender(Endpoint):
    """Sends finished prefills' KV pages to the decode nodes that ask for them."""

    def __init__(
        self,
        kv: Any,
        fingerprint: dict[str, str | int],
        host: str,
        bootstrap_port: int,
        config: TransferConfig,
        segment: SharedSegment | None = None,
        *,
        tp_size: int = 1,
        rank_segments: list[SharedSegment] | None = None,
        prepare: Callable[[list[int]], None] | None = None,
        owns_segment: bool = True,
        hooks: SendHooks | None = None,
    ) -> None:
        """`segment`: the shared-memory segment `kv` lives in (shm.shared_pool), offered to decode
        nodes on this host unless config.transport is "dist".

        A TP worker's rank 0 gives instead `rank_segments`, the segments of its `tp_size` ranks' own
        pools (rank 0's first, whose header holds the fence): a same-host decode node copies each of its
        ranks' heads straight from the rank that holds them (the runner removes them; the sender fences
        them when it closes). `kv` is then the full-head pool the pair
        group sends from, which `prepare(pages)` fills before each such send (on a pair thread).
        `owns_segment` False: `segment` outlives the sender (a worker's runner, which switches roles,
        removes it); the sender only fences it when it closes. `hooks`: test hooks acting inside each
        transfer (send_hooks.py; None: none)."""
        super().__init__(kv, fingerprint, config, tp_size)
        segments = [segment] if segment is not None else list(rank_segments or [])
        if segment is not None:
            inside = segment.pool((self._geometry.num_pages, *self._geometry.page_shape), self._kv.dtype)
            if inside.data_ptr() != self._kv.data_ptr():
                raise ValueError("the KV pool does not live in the shared-memory segment given")
        elif segments and len(segments) != tp_size:
            raise ValueError(f"{len(segments)} shared-memory segments for {tp_size} ranks")
        # A pool's segment is closed (removed) with the sender, offered or not; a TP worker's rank
        # segments belong to its runner, and the sender only fences them when it closes.
        self._own_segments = [segment] if segment is not None and owns_segment else []
        self._segments = segments if config.transport != "dist" else []
        self._prepare = prepare
        self._hooks = hooks or SendHooks()
        self._host, self._port = host, bootstrap_port
        self._errors: collections.deque[str] = collections.deque(maxlen=64)
        self.addr = ""

    # ---- public interface (any thread, non-blocking) ------------------------------------

    def start(self) -> None:
        """Bind the bootstrap ROUTER; start the I/O thread."""
        self._ctx = zmq.Context()
        if self._config.keys is not None:
            self._auth = start_authenticator(self._ctx, self._config.keys)
        router = self._ctx.socket(zmq.ROUTER)
        secure_server(router, self._config.keys, self._config.max_frame_bytes)
        router.setsockopt(zmq.LINGER, 0)
        # A decode node that reconnects (after a refusal, eviction or timeout) reuses its identity: let the
        # new connection take it over instead of having its messages dropped as a duplicate.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self._port == 0:
            port = router.bind_to_random_port(f"tcp://{self._host}")
        else:
            router.bind(f"tcp://{self._host}:{self._port}")
            port = self._port
        self.addr = f"{self._host}:{port}"
        self._thread = threading.Thread(
            target=self._io_loop, args=(router,), name="kv-sender-io", daemon=True
        )
        self._thread.start()

    def send(
        self,
        room: str,
        src_pages: list[int],
        num_tokens: int,
        metadata: FirstToken,
        block_hashes: list[int] | None = None,
    ) -> None:
        """The prefill of `room` is done: send its pages once the decode's page list is here.

        `block_hashes`: the chained hashes of the prompt's whole pages (`protocol.block_hash`); with
        them, a decode node that holds a prefix of the prompt receives only the pages after it. Without
        them, a page list that skips pages is answered with PrefixMismatch (a full transfer follows)."""
        self._mailbox.post(
            mb.Send(
                room,
                list(src_pages),
                int(num_tokens),
                metadata,
                time.monotonic(),
                list(block_hashes or []),
            )
        )

    def abort(self, room: str) -> None:
        """Give up on `room`; its FAILED result still comes out of poll() (free the pages then)."""
        self._mailbox.post(mb.Abort(room, "aborted by prefill"))

    def handshake_errors(self) -> list[str]:
        """Recent refused handshakes (fingerprint mismatches, too many pairs), oldest first."""
        return list(self._errors)

    # ---- I/O thread ---------------------------------------------------------------------------

    def _io_loop(self, router: zmq.Socket[bytes]) -> None:
        try:
            self._run_io(SenderIO(self, router))
        finally:
            router.close(linger=0)

    def close(self) -> None:
        super().close()
        for seg in self._own_segments:
            seg.close()  # fences any copy still running, removes the file
        self._own_segments = []
        if self._segments:
            self._segments[0].bump_fence()  # a copy still running is refused
