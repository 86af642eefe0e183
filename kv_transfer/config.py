"""Configuration of the KV hand-off: one frozen dataclass, built at process start and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.cluster_auth import ClusterKeys
from pdserve.config import KV_CHECKSUMS, KV_TRANSPORTS, TRANSFER_TIMEOUT_S, WAITING_TIMEOUT_S

if TYPE_CHECKING:
    from pdserve.config import WorkerConfig

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TransferConfig:
    """Timeouts and limits of the KV transfer engine (both sides read the same fields).

    backend: "gloo" (CPU pools, or CUDA pools staged through pinned host memory) or "nccl" (CUDA pools).
    transport: "dist" moves pages over the pair group only; "auto" and "shm" hand pages between two CPU
        pools of one host through shared memory (shm.py) wherever the decode node can map the prefill
        node's segment, and use the pair group otherwise ("shm" logs every such fall-back as a warning,
        "auto" once, at info).
    shm_dir: where the prefill node's segment is created and where the decode node accepts one from.
    bootstrap_timeout_s: handshake reply and building a pair's process group.
    waiting_timeout_s: a sender waiting for the decode's page list after send(); a receiver waiting for
        the data after its page list reached the prefill node (includes the prefill's queueing + forward).
    transfer_timeout_s: one send/recv operation on the pair group (a chunk or the metadata).
    max_pairs: live pair groups kept per node; the least recently used idle pair is closed beyond it.
    chunk_bytes: KV bytes per point-to-point operation; bounds the staging memory of a pair (2 buffers).
    direct_min_bytes: send pages straight from pool to pool, without staging copies, when both page
        lists run consecutively in stretches of at least this many bytes on average.
    gloo_threads: gloo worker threads per pair group.
    socket_ifname: network interface gloo binds to; None means GLOO_SOCKET_IFNAME, else the local
        address that faces the peer.
    orphan_request_ttl_s: how long a sender keeps a decode's page list for a room it has not seen yet.
    keys: the cluster's Curve keys (pdserve/cluster_auth.py): the bootstrap ROUTER and the decode's
        DEALERs run CurveZMQ and admit only holders of the secret (None: unauthenticated).
    max_frame_bytes: the largest bootstrap frame; a bigger one drops the connection (zmq MAXMSGSIZE).
    kv_checksum: which pages the sender hashes for the receiver to check (checksum.py): off | sample | all.
    max_early_lists: page lists kept per decode peer for rooms the sender has not seen yet; beyond it
        the oldest is refused (Abort). max_early_pages bounds the pages they list, per peer.
    """

    backend: str = "gloo"
    transport: str = "auto"
    shm_dir: str = "/dev/shm"
    bootstrap_timeout_s: float = 30.0
    waiting_timeout_s: float = WAITING_TIMEOUT_S
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    max_pairs: int = 32
    chunk_bytes: int = 16 << 20
    direct_min_bytes: int = 1 << 20
    gloo_threads: int = 2
    socket_ifname: str | None = None
    orphan_request_ttl_s: float = 600.0
    keys: ClusterKeys | None = None
    max_frame_bytes: int = 4 << 20
    max_early_lists: int = 1024
    max_early_pages: int = 1 << 18
    kv_checksum: str = "sample"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kv transfer backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.transport not in KV_TRANSPORTS:
            raise ValueError(f"kv transport must be one of {KV_TRANSPORTS}, got {self.transport!r}")
        if self.kv_checksum not in KV_CHECKSUMS:
            raise ValueError(f"kv checksum must be one of {KV_CHECKSUMS}, got {self.kv_checksum!r}")
        if self.max_pairs < 1:
            raise ValueError(f"max_pairs must be >= 1, got {self.max_pairs}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def default_backend(kv: torch.Tensor) -> str:
    """nccl when the pool lives on CUDA, gloo otherwise (the explicit default for --kv-transfer-backend)."""
    return "nccl" if kv.is_cuda else "gloo"


def worker_transfer_config(cfg: WorkerConfig, kv: torch.Tensor) -> TransferConfig:
    """A worker's TransferConfig (the one place it is derived): its timeouts, and its backend with
    `auto` resolved from where the pool lives."""
    backend = cfg.kv_transfer_backend
    return TransferConfig(
        backend=default_backend(kv) if backend == "auto" else backend,
        transport=cfg.kv_transport,
        waiting_timeout_s=cfg.waiting_timeout_s,
        transfer_timeout_s=cfg.transfer_timeout_s,
        kv_checksum=cfg.kv_checksum,
        keys=cfg.keys,
    )
