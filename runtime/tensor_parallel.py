"""Rank 0's side of a worker's tensor parallelism, as one object the runner holds.

`SingleProcess` (--tp-size 1) does nothing: its one pool holds every KV head and is what transfers read
and write. `RankGroup` starts ranks 1.. (runtime/tp_follower.py) before the model loads, joins the model
to their group (runtime/tp_group.py) and tells them every forward; it keeps the full-head transfer pool
that KV hand-offs read and write, and moves heads between it and the ranks' pools: over the group, or
as copies inside rank 0 once the ranks' pools are in shared memory (`share_pools`). The runner and the
workers call the same methods whatever the size; none of them asks whether TP is on.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Callable
from typing import Protocol

import torch

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.layout import kv_head_ranges
from pdserve.kv_transfer.shm import SharedSegment, ShmError, copy_heads
from pdserve.runtime.kv_pool import KVGeometry, KVPool
from pdserve.runtime.loader import LoadedModel
from pdserve.runtime.tp_follower import discard_tp_folder, rank_threads, spawn_followers
from pdserve.runtime.tp_group import ForwardCommand, TPGroup, TPGroupBroken

log = logging.getLogger(__name__)


class TensorParallel(Protocol):
    """What the runner and the workers ask of a worker's tensor parallelism."""

    size: int
    # The group the model's layers all-reduce over and live weight updates stage on (None: one process).
    group: TPGroup | None
    # Every rank's pool as rank 0 maps it once shared (`share_pools`); None: not shared, or one process.
    rank_kv: list[torch.Tensor] | None

    def join(self, loaded: LoadedModel, device: torch.device) -> None:
        """The loaded model (rank 0's part) joins the other ranks."""

    def why_not_compiled(self) -> str | None:
        """Why --enable-torch-compile cannot compile this rank's decode step; None if it can."""

    def setup_pools(self, pool: KVPool, full: KVGeometry) -> None:
        """Rank 0's pool is built (`full`: its geometry with every KV head): the other ranks build theirs."""

    def transfer_kv(self, pool_kv: torch.Tensor) -> torch.Tensor:
        """What KV transfers read and write, given rank 0's pool: a pool of every KV head."""

    def forward(self, cmd: ForwardCommand) -> None:
        """Rank 0 runs `cmd`: the other ranks run the same forward on their heads."""

    def gather_kv(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        """These pages' KV heads from every rank into the transfer pool."""

    def hand_off(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        """`gather_kv` where it must run on the loop's thread (over the group), else nothing: shared
        pools are gathered per room as a sender goes."""

    def scatter_kv(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        """These received pages of the transfer pool out to every rank's pool."""

    def share_pools(self, shared: torch.Tensor, directory: str, used: int) -> list[SharedSegment]:
        """Rank 0's pool is now `shared`: the other ranks' pools into segments of their own in
        `directory` (their first `used` pages copied); returns those segments."""

    def share_rank_pools(self, share: Callable[[], list[SharedSegment]]) -> list[SharedSegment]:
        """A receiving worker: its pools into shared memory through `share` where rank 0 must reach
        other ranks' pools (a same-host sender then writes each rank's heads straight)."""

    def failure(self) -> str | None:
        """Why this worker cannot serve (a rank exited), or None."""

    def close(self, wait_s: float) -> None:
        """Stop the other ranks (killed after `wait_s`) and remove what they met through."""


class SingleProcess:
    """--tp-size 1: one process holds the whole model and every KV head; there is nothing to tell."""

    size = 1
    group: TPGroup | None = None
    rank_kv: list[torch.Tensor] | None = None

    def join(self, loaded: LoadedModel, device: torch.device) -> None:
        pass

    def why_not_compiled(self) -> str | None:
        return None

    def setup_pools(self, pool: KVPool, full: KVGeometry) -> None:
        pass

    def transfer_kv(self, pool_kv: torch.Tensor) -> torch.Tensor:
        return pool_kv

    def forward(self, cmd: ForwardCommand) -> None:
        pass

    def gather_kv(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        pass

    def hand_off(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        pass

    def scatter_kv(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        pass

    def share_pools(self, shared: torch.Tensor, directory: str, used: int) -> list[SharedSegment]:
        return []

    def share_rank_pools(self, share: Callable[[], list[SharedSegment]]) -> list[SharedSegment]:
        return []  # the one pool is this process's: a receiver writes it itself

    def failure(self) -> str | None:
        return None

    def close(self, wait_s: float) -> None:
        pass


class RankGroup:
    """Rank 0 of a worker split over `cfg.tp_size` processes: the followers it started, their group,
    the full-head transfer pool."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        """Starts ranks 1..: they load their parts while this process loads its own."""
        self.size = cfg.tp_size
        self.group: TPGroup | None = None  # once the model joins
        self.rank_kv: list[torch.Tensor] | None = None
        self._full: torch.Tensor | None = None
        self._folder: str | None
        self._folder, self.followers = spawn_followers(cfg)

    def join(self, loaded: LoadedModel, device: torch.device) -> None:
        layout = loaded.tp_layout
        assert layout is not None and self._folder is not None  # loaded for this size (tensor_parallel)
        self.group = TPGroup(self._folder, 0, layout, device, lambda: self.failure() is None)
        loaded.model.join_group(self.group)
        pids = [p.pid for p in self.followers]
        log.info("tensor parallel: %s, ranks 1-%d in processes %s", layout.describe(), self.size - 1, pids)

    def _group(self) -> TPGroup:
        if self.group is None:
            raise TPGroupBroken("the TP group is closed")
        return self.group

    def why_not_compiled(self) -> str | None:
        return "a TP rank's layers all-reduce"

    def setup_pools(self, pool: KVPool, full: KVGeometry) -> None:
        self._group().setup(pool.num_pages, full.dtype, full.page_size)
        self._full = KVPool(full, pool.num_pages, pool.kv.device).kv

    def transfer_kv(self, pool_kv: torch.Tensor) -> torch.Tensor:
        assert self._full is not None, "setup_pools first"
        return self._full

    def forward(self, cmd: ForwardCommand) -> None:
        self._group().send_command(*cmd.encode())

    def _heads(self) -> tuple[list[range], list[range]]:
        """(each rank's KV heads, every KV head as one range)."""
        n = self._group().layout.num_kv_heads
        return kv_head_ranges(n, self.size), [range(n)]

    def gather_kv(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        """Copies inside rank 0 where the ranks' pools are shared (any thread), else over the group
        (the loop's thread)."""
        full = self.transfer_kv(pool_kv)
        if self.rank_kv is not None:
            split, every = self._heads()
            copy_heads(self.rank_kv, split, pages, [full], every, pages)
        else:
            self._group().gather_kv(pool_kv, full, pages)

    def hand_off(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        if self.rank_kv is None:
            self.gather_kv(pool_kv, pages)

    def scatter_kv(self, pool_kv: torch.Tensor, pages: list[int]) -> None:
        full = self.transfer_kv(pool_kv)
        if self.rank_kv is not None:
            split, every = self._heads()
            copy_heads([full], every, pages, self.rank_kv, split, pages)
        else:
            self._group().scatter_kv(pool_kv, full, pages)

    def share_pools(self, shared: torch.Tensor, directory: str, used: int) -> list[SharedSegment]:
        """Each other rank's pool in its own segment that rank 0 makes and the rank maps and moves its
        pool into; rank 0 then reads and writes every rank's heads itself (`rank_kv`)."""
        segments: list[SharedSegment] = []
        pools = [shared]
        try:
            for _ in range(1, self.size):
                segments.append(SharedSegment.create(shared.numel() * shared.element_size(), directory))
                pools.append(segments[-1].pool(tuple(shared.shape), shared.dtype))
                if not segments[-1].commit(used * shared[0].nbytes):
                    raise ShmError(f"no room in {directory} for the {used} KV pages in use")
            self._group().share_pools([(seg.path, seg.token) for seg in segments], used)
        except BaseException:
            for seg in segments:
                seg.close()
            raise
        self.rank_kv = pools
        return segments

    def share_rank_pools(self, share: Callable[[], list[SharedSegment]]) -> list[SharedSegment]:
        return share()

    def failure(self) -> str | None:
        for rank, p in enumerate(self.followers, start=1):
            if p.poll() is not None:
                return f"TP rank {rank} exited ({p.returncode})"
        return None

    def close(self, wait_s: float) -> None:
        """The followers would die with this process anyway; their folder and shared-memory segment
        would not."""
        if self.group is not None and self.failure() is None:
            with contextlib.suppress(TPGroupBroken):
                self.group.stop()
        for p in self.followers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=wait_s)
            if p.poll() is None:
                p.kill()
                p.wait()
        self.followers, self.group, self.rank_kv = [], None, None
        if self._folder is not None:
            discard_tp_folder(self._folder)
            self._folder = None


def tensor_parallel(cfg: RuntimeConfig, loaded: LoadedModel | None) -> TensorParallel:
    """The worker's tensor parallelism for --tp-size, its ranks started (`loaded`: a model the caller
    loaded already, which must be split for that size). Sets this process's intra-op threads: on CPU
    the ranks share the cores."""
    if loaded is not None and (loaded.tp_layout.size if loaded.tp_layout else 1) != cfg.tp_size:
        raise ValueError(f"a model loaded for another TP size than --tp-size {cfg.tp_size}")
    threads = rank_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    return SingleProcess() if cfg.tp_size == 1 else RankGroup(cfg)
