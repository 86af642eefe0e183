"""A tensor-parallel worker's own process group, and what its ranks say to each other over it.

The N processes of one worker meet through a FileStore in a private folder that rank 0 makes (mode
0700) and build ProcessGroupGloo (bound to 127.0.0.1: the ranks share a host) or ProcessGroupNCCL
directly, with no default process group, as the KV pairs do. CPU ranks all-reduce through a shared-memory
segment instead of gloo where the tensor fits its slots (runtime/tp_shm.py). Rank 0 schedules; before every forward it
broadcasts the forward's description, and the other ranks (runtime/tp_follower.py) run the same forward
on their weights and their heads of the pool. Commands are int64 tensors of a fixed shape, never pickles:
a header [command, payload length, mode, all_logits, batch size, 0], then the payload.

Rank 0 waits at most RANK_TIMEOUT_S for the others in any operation; a rank that died or hung breaks
the group, and `TPGroupBroken` ends the worker as one unit (the launcher restarts it, followers die
with their rank 0: tp_follower.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    BroadcastOptions,
    FileStore,
    ProcessGroupGloo,
    Work,
)

from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.tp_layout import TPLayout
from pdserve.runtime.tp_shm import ShmAllReduce

RANK_TIMEOUT_S = 300.0
# Followers wait for rank 0's next command without a deadline (an idle worker sends none); they die
# with rank 0 (PR_SET_PDEATHSIG) instead.
IDLE_WAIT = timedelta(days=365)

CMD_FORWARD, CMD_GATHER_KV, CMD_SCATTER_KV, CMD_STOP, CMD_SETUP, CMD_SHARE_POOL = 1, 2, 3, 4, 5, 6
# Live weight updates (runtime/weight_update.py): stage a checkpoint's cut in the background, swap, drop.
CMD_WEIGHTS_STAGE, CMD_WEIGHTS_COMMIT, CMD_WEIGHTS_CANCEL = 7, 8, 9
WEIGHTS_FILE = "weights.json"  # in the rendezvous folder: what CMD_WEIGHTS_STAGE stages
POOLS_FILE = "pools"  # in the rendezvous folder: each other rank's pool segment, `path token` per line
_MODES = list(ForwardMode)
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADER = 6


class _Collectives(Protocol):
    """What a TP group uses of its c10d backend; torch's stubs omit these on ProcessGroupGloo and
    ProcessGroupNCCL, which both have them at runtime."""

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Work: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> Work: ...

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Work: ...


class TPGroupBroken(BaseException):
    """A rank of this worker died or stopped answering: the worker cannot go on. A BaseException, as
    SystemExit is: the handlers that fail one request for its own exception must not catch it."""


@dataclass(frozen=True)
class ForwardCommand:
    mode: ForwardMode
    new_tokens: list[list[int]]
    prefix_lens: list[int]
    page_tables: list[list[int]]
    all_logits: bool | None

    def encode(self) -> tuple[list[int], list[int]]:
        """(header, payload)."""
        b = len(self.new_tokens)
        counts: list[int] = []
        for toks, prefix, pages in zip(self.new_tokens, self.prefix_lens, self.page_tables):
            counts += [len(toks), prefix, len(pages)]
        flat = [t for toks in self.new_tokens for t in toks] + [
            p for pages in self.page_tables for p in pages
        ]
        payload = counts + flat
        logits = -1 if self.all_logits is None else int(self.all_logits)
        return [CMD_FORWARD, len(payload), _MODES.index(self.mode), logits, b, 0], payload

    @classmethod
    def decode(cls, header: list[int], payload: list[int]) -> ForwardCommand:
        _, _, mode, logits, b, _ = header
        counts, rest = payload[: 3 * b], payload[3 * b :]
        lens, prefixes, npages = counts[0::3], counts[1::3], counts[2::3]
        if len(rest) != sum(lens) + sum(npages) or min(lens + prefixes + npages, default=0) < 0:
            raise ValueError("malformed forward command")
        tokens, at = [], 0
        for n in lens:
            tokens.append(rest[at : at + n])
            at += n
        tables = []
        for n in npages:
            tables.append(rest[at : at + n])
            at += n
        return cls(_MODES[mode], tokens, prefixes, tables, None if logits < 0 else bool(logits))

    def batch(self, page_size: int, device: torch.device) -> ForwardBatch:
        return ForwardBatch.build(
            self.mode, self.new_tokens, self.prefix_lens, self.page_tables, page_size, device, self.all_logits
        )


class TPGroup:
    """One rank's handle on its worker's group; every collective here blocks until all ranks join."""

    def __init__(
        self,
        folder: str,
        rank: int,
        layout: TPLayout,
        device: torch.device,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """`folder`: rank 0's rendezvous folder (tp_follower.spawn_followers); `alive`: whether every
        other rank still runs (rank 0 asks its children), checked while an all-reduce waits."""
        self.rank, self.size, self.layout, self.device = rank, layout.size, layout, device
        self.folder = folder
        self._alive = alive
        with open(os.path.join(folder, "allreduce")) as f:
            segment = f.read().strip()
        self._shm = ShmAllReduce(segment, rank, layout.size) if segment else None
        self._store = FileStore(os.path.join(folder, "store"), layout.size)  # outlives the group using it
        self._store.set_timeout(timedelta(seconds=RANK_TIMEOUT_S))
        if device.type == "cuda":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            torch.cuda.set_device(device)
            nccl_opts = ProcessGroupNCCL.Options()
            nccl_opts._timeout = IDLE_WAIT
            self._pg = cast(_Collectives, ProcessGroupNCCL(self._store, rank, layout.size, nccl_opts))
        else:
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = IDLE_WAIT
            opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self._pg = cast(_Collectives, ProcessGroupGloo(self._store, rank, layout.size, opts))
        self._wait_limit = None if rank else timedelta(seconds=RANK_TIMEOUT_S)
        if segment and rank == 0:  # every rank has mapped it (the group's rendezvous is behind us)
            os.unlink(segment)
        # Seconds this rank spent in each kind of operation, waiting for the others included
        # (`pdserve bench tp` reads them: where a TP forward's time goes).
        self.seconds: dict[str, float] = {"all_reduce": 0.0, "all_gather": 0.0, "command": 0.0, "kv": 0.0}

    def _timed(self, kind: str, work: Work, t0: float) -> None:
        self._wait(work)
        self.seconds[kind] += time.perf_counter() - t0

    def _wait(self, work: Work) -> None:
        try:
            done = work.wait(self._wait_limit) if self._wait_limit is not None else work.wait()
        except RuntimeError as exc:
            raise TPGroupBroken(f"TP rank {self.rank}: the group broke: {exc}") from exc
        if not done:
            raise TPGroupBroken(
                f"TP rank {self.rank}: no answer from the other ranks in {RANK_TIMEOUT_S:.0f}s"
            )

    # ---- collectives of the model ---------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        t0 = time.perf_counter()
        if self._shm is not None and self._shm.fits(t):
            buf = t if t.is_contiguous() else t.contiguous()
            try:
                self._shm.all_reduce(buf, self._alive, None if self.rank else RANK_TIMEOUT_S)
            except (ConnectionError, TimeoutError) as exc:
                raise TPGroupBroken(f"TP rank {self.rank}: {exc}") from exc
            if buf is not t:
                t.copy_(buf)
            self.seconds["all_reduce"] += time.perf_counter() - t0
            return
        self._timed("all_reduce", self._pg.allreduce([t], AllreduceOptions()), t0)

    def all_gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[N, c] on each rank -> [N, size * c], rank-major columns."""
        t0 = time.perf_counter()
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self._timed("all_gather", self._pg.allgather([outs], [t]), t0)
        return torch.cat(outs, dim=-1)

    # ---- commands from rank 0 ------------------------------------------------------------

    def _broadcast(self, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        opts = BroadcastOptions()
        opts.rootRank = 0
        self._timed("command", self._pg.broadcast([t], opts), t0)

    def send_command(self, header: list[int], payload: list[int]) -> None:
        """Rank 0: a command to every other rank."""
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        if payload:
            self._broadcast(torch.tensor(payload, dtype=torch.int64))

    def next_command(self) -> tuple[list[int], list[int]]:
        """Another rank: wait for rank 0's next command."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        self._broadcast(header)
        head = header.tolist()
        if head[1] < 0:
            raise ValueError("malformed command header")
        payload = torch.zeros(head[1], dtype=torch.int64)
        if head[1]:
            self._broadcast(payload)
        return head, payload.tolist()

    # ---- KV between the ranks' pools and the full-head transfer pool ----------------------

    def holders(self) -> list[tuple[int, range]]:
        """(rank, KV heads) that together cover every KV head once: the first rank holding each."""
        seen: set[int] = set()
        out = []
        for r in range(self.size):
            heads = self.layout.kv_heads(r)
            if heads.start not in seen:
                seen.update(heads)
                out.append((r, heads))
        return out

    def gather_kv(self, pool: torch.Tensor, full: torch.Tensor, pages: list[int]) -> None:
        """Rank 0: full[pages] = every rank's heads of those pages (the other ranks run `give_kv`)."""
        if not pages:
            return
        t0, idx = self._kv_command(CMD_GATHER_KV, pages, pool.device)
        for r, heads in self.holders():
            part = pool.index_select(0, idx) if r == 0 else self._recv_pages(pool, len(pages), r)
            full[idx, :, :, :, heads.start : heads.stop] = part
        self.seconds["kv"] += time.perf_counter() - t0

    def _kv_command(self, cmd: int, pages: list[int], device: torch.device) -> tuple[float, torch.Tensor]:
        """Rank 0: tell the others which pages move; (the start time, the page ids as a tensor)."""
        self.send_command([cmd, len(pages), 0, 0, 0, 0], pages)
        return time.perf_counter(), torch.tensor(pages, dtype=torch.int64, device=device)

    def give_kv(self, pool: torch.Tensor, pages: list[int]) -> None:
        """Another rank: its heads of `pages` to rank 0, if it is the first holder of them."""
        if any(r == self.rank for r, _ in self.holders()):
            idx = torch.tensor(pages, dtype=torch.int64, device=pool.device)
            self._wait(self._pg.send([pool.index_select(0, idx).contiguous()], 0, 0))

    def scatter_kv(self, pool: torch.Tensor, full: torch.Tensor, pages: list[int]) -> None:
        """Rank 0: every rank's pool[pages] = its heads of full[pages] (the others run `take_kv`)."""
        if not pages:
            return
        t0, idx = self._kv_command(CMD_SCATTER_KV, pages, pool.device)
        rows = full.index_select(0, idx)
        for r in range(self.size):
            heads = self.layout.kv_heads(r)
            part = rows[:, :, :, :, heads.start : heads.stop].contiguous()
            if r == 0:
                pool.index_copy_(0, idx, part)
            else:
                self._wait(self._pg.send([part], r, 0))
        self.seconds["kv"] += time.perf_counter() - t0

    def take_kv(self, pool: torch.Tensor, pages: list[int]) -> None:
        """Another rank: its heads of `pages` from rank 0, into its pool."""
        idx = torch.tensor(pages, dtype=torch.int64, device=pool.device)
        pool.index_copy_(0, idx, self._recv_pages(pool, len(pages), 0))

    def _recv_pages(self, pool: torch.Tensor, n: int, src: int) -> torch.Tensor:
        part = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
        self._wait(self._pg.recv([part], src, 0))
        return part

    def setup(self, num_pages: int, kv_dtype: torch.dtype, page_size: int) -> None:
        """Rank 0: the pool every other rank builds (its own KV heads of the same pages)."""
        self.send_command([CMD_SETUP, 0, num_pages, KV_DTYPES.index(kv_dtype), page_size, 0], [])

    def share_pools(self, segments: list[tuple[str, bytes]], used_pages: int) -> None:
        """Rank 0: rank r (1..) moves its pool into the segment `segments[r - 1]` (path, token), its
        first `used_pages` pages copied; returns once every rank has (the others run `pool_segment`
        and `shared`)."""
        with open(os.path.join(self.folder, POOLS_FILE), "w") as f:  # the folder is rank 0's, mode 0700
            f.writelines(f"{path} {token.hex()}\n" for path, token in segments)
        self.send_command([CMD_SHARE_POOL, 0, used_pages, 0, 0, 0], [])
        self.shared()

    def pool_segment(self) -> tuple[str, bytes]:
        """Another rank: the (path, token) of the segment its pool moves into."""
        with open(os.path.join(self.folder, POOLS_FILE)) as f:
            path, token = f.read().splitlines()[self.rank - 1].split()
        return path, bytes.fromhex(token)

    def shared(self) -> None:
        """Every rank: wait until all have moved their pools (a one-element all-reduce over the group)."""
        one = torch.zeros(1, device=self.device)
        self._timed("kv", self._pg.allreduce([one], AllreduceOptions()), time.perf_counter())

    def weights(self, cmd: int, what: dict[str, object] | None = None) -> None:
        """Rank 0: a weights command to the other ranks; `what` (CMD_WEIGHTS_STAGE) goes through the
        rendezvous folder (rank 0's, mode 0700): {"folder" or "model_path", "load_format", "require_all"}."""
        if what is not None:
            path = os.path.join(self.folder, WEIGHTS_FILE)
            with open(path + ".tmp", "w") as f:
                json.dump(what, f)
            os.replace(path + ".tmp", path)
        self.send_command([cmd, 0, 0, 0, 0, 0], [])

    def staged_request(self) -> dict[str, object]:
        """Another rank: what CMD_WEIGHTS_STAGE asks it to stage."""
        with open(os.path.join(self.folder, WEIGHTS_FILE)) as f:
            what: dict[str, object] = json.load(f)
        return what

    def say_failed(self, why: str) -> None:
        """Another rank: why it could not stage its cut (rank 0 reads it with `why_failed`)."""
        with open(os.path.join(self.folder, f"weights-error-{self.rank}"), "w") as f:
            f.write(why[:2000])

    def why_failed(self) -> list[str]:
        """Rank 0: what the ranks that could not stage their cut said (and forget it)."""
        out = []
        for r in range(1, self.size):
            path = os.path.join(self.folder, f"weights-error-{r}")
            if os.path.exists(path):
                with open(path) as f:
                    out.append(f"TP rank {r}: {f.read()}")
                os.unlink(path)
        return out

    def failed_ranks(self, failed: bool) -> int:
        """Every rank: how many ranks could not stage their cut (each says whether it did)."""
        t = torch.tensor([float(failed)], device=self.device)  # NCCL reduces only device tensors
        self._timed("command", self._pg.allreduce([t], AllreduceOptions()), time.perf_counter())
        return int(t.item())

    def stop(self) -> None:
        self.send_command([CMD_STOP, 0, 0, 0, 0, 0], [])
        if self._shm is not None:
            self._shm.close()
