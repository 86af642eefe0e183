"""One pair's two-rank process group (rank 0 = prefill/sender, rank 1 = decode/receiver) and its data path.

No global init_process_group: each pair builds ProcessGroupGloo / ProcessGroupNCCL directly over
PrefixStore(f"pair/{pair_id}/{gen}", the generation's PairStore): the two ranks meet through keys carried
on the pair's own control channel (pair_store.py), so no store port is opened. A group that saw a timeout
or a peer failure is dead for good: the owner drops it and builds generation gen+1.

gloo's device listens on a port for the whole life of the group and accepts every connection; one that
does not complete gloo's handshake is never closed (a raw connect stays open waiting for a sequence
number, one that sends an unknown number is kept for a later wait), and torch gives no way to stop the
listener. Only destroying the group (the last reference to its device) closes the listener and every
connection it accepted: `close()` drops it, and a pair rebuilds a group whose port holds more than
MAX_STRAY_CONNECTIONS such connections (`stray_connections`, checked around each transfer).

Called only from a pair's own thread; every operation here may block up to its timeout.
"""

from __future__ import annotations

import collections
import os
from datetime import timedelta
from typing import Protocol, cast

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Work

from pdserve import env
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.layout import (
    PoolGeometry,
    chunk_ranges,
    chunk_tag,
    chunk_view,
    gather_pages,
    run_starts,
    scatter_pages,
    trailer_tag,
)
from pdserve.kv_transfer.pair_store import PairStore

SENDER_RANK = 0
RECEIVER_RANK = 1
# Connections a group's gloo listener may hold beyond its peer's before the pair rebuilds the group.
MAX_STRAY_CONNECTIONS = 64
STRAY_CHECK_S = 5.0  # how often a pair thread looks for stray connections on its group's port
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


class _PointToPoint(Protocol):
    """What a pair uses of its c10d backend. torch's stubs omit send/recv on ProcessGroupGloo and
    ProcessGroupNCCL, which both have them at runtime, hence the casts where the group is built."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Work: ...


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _listen_port(store: PairStore, prefix: str, rank: int) -> int | None:
    """The port of this rank's gloo listener: the address it published holds a sockaddr (the family, 2
    bytes little-endian, then the port big-endian) at an offset that varies; the port is the one that a
    listening socket has. None when none matches."""
    value = next((v for k, v in store.items() if k.startswith(prefix) and k.endswith(f"/{rank}")), None)
    if value is None:
        return None
    listening = _tcp_ports(listening=True)
    for i in range(len(value) - 3):
        if value[i : i + 2] in (b"\x02\x00", b"\x0a\x00"):  # AF_INET, AF_INET6
            port = int.from_bytes(value[i + 2 : i + 4], "big")
            if port in listening:
                return port
    return None


def _tcp_ports(listening: bool) -> collections.Counter[int]:
    """Local ports of the host's TCP sockets (LISTEN ones, or the others), with how many sockets each."""
    ports: collections.Counter[int] = collections.Counter()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split(maxsplit=4)
                    if (fields[3] == _TCP_LISTEN) == listening:
                        ports[int(fields[1].rsplit(":", 1)[1], 16)] += 1
        except (OSError, ValueError, IndexError):
            continue
    return ports


def _gloo_device(config: TransferConfig, local_host: str) -> ProcessGroupGloo.Device:
    ifname = config.socket_ifname or env.gloo_socket_ifname()
    if ifname:
        return ProcessGroupGloo.create_device(interface=ifname)
    return ProcessGroupGloo.create_device(hostname=local_host)


class PairGroup:
    """A live process group for one (prefill, decode) pair and generation, with reusable staging buffers."""

    def __init__(
        self,
        *,
        store: PairStore,
        pair_id: str,
        gen: int,
        rank: int,
        local_host: str,
        kv: torch.Tensor,
        config: TransferConfig,
    ) -> None:
        self.gen = gen
        self.rank = rank
        self._peer = RECEIVER_RANK if rank == SENDER_RANK else SENDER_RANK
        self._config = config
        self._device = kv.device
        # gloo moves host memory: a CUDA pool is staged through pinned host buffers.
        self._stage_on_host = config.backend == "gloo" and kv.is_cuda
        connect_timeout = timedelta(seconds=config.bootstrap_timeout_s)
        store.set_timeout(connect_timeout)
        self._store = store  # the Python object must outlive the group that calls into it
        prefixed = PrefixStore(f"pair/{pair_id}/{gen}", store)
        if config.backend == "gloo":
            # torch's stub declares Options (devices, threads); the runtime class is _Options (_devices...).
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = connect_timeout  # connect; each op waits with transfer_timeout_s
            opts._threads = config.gloo_threads
            opts._devices = [_gloo_device(config, local_host)]
            self._pg: _PointToPoint | None = cast(_PointToPoint, ProcessGroupGloo(prefixed, rank, 2, opts))
        else:
            if not kv.is_cuda:
                raise ValueError("the nccl kv transfer backend needs the KV pool on a CUDA device")
            from torch._C._distributed_c10d import ProcessGroupNCCL

            torch.cuda.set_device(kv.device)
            nccl_opts = ProcessGroupNCCL.Options()
            nccl_opts._timeout = timedelta(seconds=config.transfer_timeout_s)
            nccl = ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)
            # NCCL communicators are created lazily at the first op; connect now, on this control thread,
            # and pass one byte so the point-to-point path is set up before the first transfer.
            nccl.eager_connect_single_device(kv.device)
            self._pg = cast(_PointToPoint, nccl)
        self._listen_port = (
            _listen_port(store, f"pair/{pair_id}/{gen}/", rank) if config.backend == "gloo" else None
        )
        self._open_files_at_build = _open_files()
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (compute-side, wire-side) flat uint8
        self._buffer_bytes = 0
        if config.backend == "nccl":
            probe = torch.zeros(1, dtype=torch.uint8, device=kv.device)
            op = self._p2p.send if rank == SENDER_RANK else self._p2p.recv
            self._wait(op([probe], self._peer, 0))
            torch.cuda.current_stream(kv.device).synchronize()  # deliberate: the build is complete here

    def close(self) -> None:
        """Drop the group: with its last reference its gloo device goes, closing the listener and every
        connection it accepted."""
        self._pg = None
        self._buffers = []

    def stray_connections(self) -> int:
        """Connections on this group's gloo listener beyond its peer's (raw connects that gloo keeps);
        counted only once the process holds MAX_STRAY_CONNECTIONS more files than at the build."""
        if self._listen_port is None or _open_files() - self._open_files_at_build <= MAX_STRAY_CONNECTIONS:
            return 0
        return max(0, _tcp_ports(listening=False)[self._listen_port] - 1)

    @property
    def _p2p(self) -> _PointToPoint:
        if self._pg is None:
            raise RuntimeError(f"pair group gen {self.gen} used after close")
        return self._pg

    # ---- data path -----------------------------------------------------------------------

    def _staging(self, nbytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Two (compute, wire) flat byte buffers of at least nbytes: one gathers while the other is sent."""
        if nbytes > self._buffer_bytes:
            self._buffers = []
            for _ in range(2):
                compute = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
                wire = (
                    torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    if self._stage_on_host
                    else compute
                )
                self._buffers.append((compute, wire))
            self._buffer_bytes = nbytes
        return self._buffers

    def _wait(self, work: Work) -> None:
        if not work.wait(timedelta(seconds=self._config.transfer_timeout_s)):
            raise TimeoutError(f"pair group op timed out after {self._config.transfer_timeout_s}s")

    @property
    def can_send_direct(self) -> bool:
        """Whether pool memory can go on the wire as it is (not when gloo must stage a CUDA pool)."""
        return not self._stage_on_host

    def _send_trailer(self, seq: int, trailer: bytes) -> None:
        tail = torch.frombuffer(bytearray(trailer), dtype=torch.uint8)
        if self._config.backend == "nccl":
            tail = tail.to(self._device)
        self._wait(self._p2p.send([tail], self._peer, trailer_tag(seq)))
        if self._config.backend == "nccl":
            torch.cuda.current_stream(self._device).synchronize()  # deliberate: report only when sent

    def _recv_trailer(self, seq: int, trailer_len: int) -> bytes:
        tail = torch.empty(
            trailer_len, dtype=torch.uint8, device=self._device if self._config.backend == "nccl" else "cpu"
        )
        self._wait(self._p2p.recv([tail], self._peer, trailer_tag(seq)))
        if self._config.backend == "nccl":
            torch.cuda.current_stream(self._device).synchronize()  # deliberate: commit only landed pages
        return bytes(tail.cpu().numpy().tobytes())

    def send_direct(
        self, kv: torch.Tensor, page_ids: list[int], runs: list[int], seq: int, trailer: bytes
    ) -> int:
        """Send each run of consecutive pages straight from the pool (no copy), then the trailer."""
        blocks = kv.view(kv.shape[0], -1).view(torch.uint8)  # [pages, page_bytes]
        works = [
            self._p2p.send([blocks[page_ids[at] : page_ids[at] + n].view(-1)], self._peer, chunk_tag(seq, i))
            for i, (at, n) in enumerate(zip(run_starts(runs), runs))
        ]
        for work in works:
            self._wait(work)
        self._send_trailer(seq, trailer)
        return len(page_ids) * blocks.shape[1]

    def recv_direct(
        self, kv: torch.Tensor, page_ids: list[int] | None, runs: list[int], seq: int, trailer_len: int
    ) -> bytes:
        """Receive each run straight into its pool pages (None: drain into a scratch buffer)."""
        blocks = kv.view(kv.shape[0], -1).view(torch.uint8)
        if page_ids is None:
            scratch = torch.empty_like(blocks[: max(runs)])
            dsts = [scratch[:n] for n in runs]
        else:
            dsts = [blocks[page_ids[at] : page_ids[at] + n] for at, n in zip(run_starts(runs), runs)]
        works = [self._p2p.recv([dst.view(-1)], self._peer, chunk_tag(seq, i)) for i, dst in enumerate(dsts)]
        for work in works:
            self._wait(work)
        return self._recv_trailer(seq, trailer_len)

    def send_pages(
        self,
        kv: torch.Tensor,
        geometry: PoolGeometry,
        page_ids: list[int],
        per_chunk: int,
        seq: int,
        trailer: bytes,
    ) -> int:
        """Gather page_ids chunk by chunk and send them, then the trailer. Returns KV bytes sent."""
        ids = torch.tensor(page_ids, dtype=torch.long, device=kv.device)
        ranges = chunk_ranges(len(page_ids), per_chunk)
        buffers = self._staging(min(per_chunk, len(page_ids)) * geometry.page_bytes)
        pending: list[Work | None] = [None, None]
        for index, (start, end) in enumerate(ranges):
            slot = index % 2
            if (previous := pending[slot]) is not None:
                self._wait(previous)  # the buffer is free again once its send completed
            compute, wire = buffers[slot]
            nbytes = (end - start) * geometry.page_bytes
            gather_pages(kv, ids[start:end], chunk_view(compute, geometry, end - start))
            if self._stage_on_host:
                wire[:nbytes].copy_(compute[:nbytes])  # deliberate device sync: gloo reads host memory
            pending[slot] = self._p2p.send([wire[:nbytes]], self._peer, chunk_tag(seq, index))
        for work in pending:
            if work is not None:
                self._wait(work)
        self._send_trailer(seq, trailer)
        return len(page_ids) * geometry.page_bytes

    def recv_pages(
        self,
        kv: torch.Tensor,
        geometry: PoolGeometry,
        page_ids: list[int] | None,
        num_pages: int,
        per_chunk: int,
        seq: int,
        trailer_len: int,
    ) -> bytes:
        """Receive num_pages pages chunk by chunk and scatter them into page_ids (None: drain and discard).

        Returns the trailer bytes. The next chunk's recv is posted before the current one is scattered.
        """
        ids = None if page_ids is None else torch.tensor(page_ids, dtype=torch.long, device=kv.device)
        ranges = chunk_ranges(num_pages, per_chunk)
        buffers = self._staging(min(per_chunk, max(num_pages, 1)) * geometry.page_bytes)

        def post(index: int) -> Work:
            start, end = ranges[index]
            wire = buffers[index % 2][1]
            return self._p2p.recv(
                [wire[: (end - start) * geometry.page_bytes]], self._peer, chunk_tag(seq, index)
            )

        pending = post(0) if ranges else None
        for index, (start, end) in enumerate(ranges):
            following = post(index + 1) if index + 1 < len(ranges) else None
            assert pending is not None  # posted before the loop or by the previous round
            self._wait(pending)
            if ids is not None:
                compute, wire = buffers[index % 2]
                nbytes = (end - start) * geometry.page_bytes
                if self._stage_on_host:
                    compute[:nbytes].copy_(wire[:nbytes])
                scatter_pages(kv, ids[start:end], chunk_view(compute, geometry, end - start))
            pending = following
        return self._recv_trailer(seq, trailer_len)
