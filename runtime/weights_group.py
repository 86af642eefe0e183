"""The process group a trainer and the workers share to move new weights without files.

Both ends call `join_weights_group`: the trainer as rank 0 (it hosts the TCPStore at
master_address:master_port), each worker as its rank. Like the KV pair groups, it is built without
torch's default group (a worker has no global process group): a ProcessGroupGloo (CPU tensors) or
ProcessGroupNCCL (CUDA tensors) over `PrefixStore(f"{group_name}/", TCPStore)`. The trainer then
`broadcast`s each tensor from rank 0, in the order it announced (`/update_weights_from_distributed`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol, cast

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore, Work


class _Broadcaster(Protocol):
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> Work: ...


class WeightsGroup:
    """One side's membership of a weights group; `broadcast` sends (rank 0) or receives (the others)."""

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        local_host: str | None = None,
        timeout_s: float = 120.0,
        device: torch.device | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = device or torch.device("cuda" if backend == "nccl" else "cpu")
        self._store = TCPStore(master_address, master_port, world_size, rank == 0, timeout)
        prefixed = PrefixStore(f"{group_name}/", self._store)
        if backend == "gloo":
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            host = local_host or master_address
            opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
            self._pg = cast(_Broadcaster, ProcessGroupGloo(prefixed, rank, world_size, opts))
        elif backend == "nccl":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            nccl_opts = ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            self._pg = cast(_Broadcaster, ProcessGroupNCCL(prefixed, rank, world_size, nccl_opts))
        else:
            raise ValueError(f"unknown backend {backend!r}; choose gloo or nccl")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every other rank's `tensor` (same shape and dtype), waiting for it."""
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        self._pg = cast(_Broadcaster, None)
