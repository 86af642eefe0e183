"""The ranks 1..N-1 of a tensor-parallel worker: each loads its part of the model, builds its own KV pool
(its KV heads of the same pages as rank 0's) and runs whatever forward rank 0 describes, in lockstep.

Rank 0 (runtime/runner.py) starts them with `spawn_followers`, as children that die with it (the
launchers' `die_with`, PR_SET_PDEATHSIG):
a worker is one unit, whichever of its processes dies. A follower that loses its group exits non-zero,
and rank 0 sees the broken group at its next operation (runtime/tp_group.py TPGroupBroken).

    python -m pdserve.runtime.tp_follower <folder> <rank>

`folder` is rank 0's private rendezvous folder: the FileStore and config.json (the RuntimeConfig).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdserve import env
from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.layout import geometry_of as pool_geometry
from pdserve.kv_transfer.shm import MappedPool
from pdserve.launch.supervisor import die_with
from pdserve.runtime.tp_group import (
    CMD_FORWARD,
    CMD_GATHER_KV,
    CMD_SCATTER_KV,
    CMD_SETUP,
    CMD_SHARE_POOL,
    CMD_STOP,
    CMD_WEIGHTS_CANCEL,
    CMD_WEIGHTS_COMMIT,
    CMD_WEIGHTS_STAGE,
    KV_DTYPES,
    ForwardCommand,
    TPGroup,
    TPGroupBroken,
)
from pdserve.runtime.tp_shm import make_segment
from pdserve.runtime.weight_update import Copies, apply, stage_rank_cut
from pdserve.side_threads import serial_openmp

log = logging.getLogger(__name__)


def rank_device(cfg: RuntimeConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or the GPU `rank` places after rank 0's."""
    dev = torch.device(cfg.resolved_device())
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def rank_threads(cfg: RuntimeConfig) -> int | None:
    """Intra-op threads of each rank: on CPU the worker's (--num-threads, or the host's cores) shared
    among its ranks."""
    if cfg.tp_size == 1 or torch.device(cfg.resolved_device()).type != "cpu":
        return cfg.num_threads
    return max(1, (cfg.num_threads or os.cpu_count() or 1) // cfg.tp_size)


def spawn_followers(cfg: RuntimeConfig) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Start ranks 1..tp_size-1; returns the rendezvous folder (store at <folder>/store) and them."""
    folder = tempfile.mkdtemp(prefix="pdserve-tp-")  # mode 0700: only this user meets there
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    segment = ""
    if rank_device(cfg, 0).type == "cpu" and env.tp_shm_allreduce() and os.path.isdir("/dev/shm"):
        segment = f"/dev/shm/pdserve-tp-{os.getpid()}-{secrets.token_hex(8)}"
        make_segment(segment, cfg.tp_size)  # unlinked by rank 0 once every rank has mapped it
    with open(os.path.join(folder, "allreduce"), "w") as f:
        f.write(segment)
    argv = [sys.executable, "-P", "-m", "pdserve.runtime.tp_follower", folder]
    procs = [
        subprocess.Popen([*argv, str(rank)], preexec_fn=die_with(os.getpid()))  # noqa: PLW1509
        for rank in range(1, cfg.tp_size)
    ]
    return folder, procs


def discard_tp_folder(folder: str) -> None:
    """Remove rank 0's rendezvous folder and the shared-memory segment it names (rank 0 unlinks that
    once every rank has mapped it; a worker that stopped before then leaves it to this)."""
    try:
        with open(os.path.join(folder, "allreduce")) as f:
            segment = f.read().strip()
        if segment:
            os.unlink(segment)
    except FileNotFoundError:
        pass
    shutil.rmtree(folder, ignore_errors=True)


def follow(folder: str, rank: int) -> None:
    from pdserve.runtime.attention import make_attention_backend
    from pdserve.runtime.kv_pool import KVGeometry, KVPool
    from pdserve.runtime.loader import load_model

    with open(os.path.join(folder, "config.json")) as f:
        cfg = RuntimeConfig(**json.load(f))
    device = rank_device(cfg, rank)
    threads = rank_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(
        cfg.model_path,
        cfg.dtype,
        str(device),
        cfg.quantization,
        cfg.deterministic,
        cfg.attention_backend,
        cfg.tp_size,
        rank,
    )
    assert loaded.tp_layout is not None
    group = TPGroup(folder, rank, loaded.tp_layout, device)
    model = loaded.model
    model.join_group(group)
    head, _ = group.next_command()
    if head[0] != CMD_SETUP or not 0 <= head[3] < len(KV_DTYPES):
        raise ValueError(f"TP rank {rank}: expected the pool's setup, got command {head[0]}")
    spec, num_pages, page_size = loaded.spec, head[2], head[4]
    geometry = KVGeometry(
        spec.num_layers, loaded.tp_layout.kv_heads_per_rank, spec.head_dim, page_size, KV_DTYPES[head[3]]
    )
    pool = KVPool(geometry, num_pages, device)
    backend = make_attention_backend(cfg.attention_backend, device, batch_invariant=loaded.batch_invariant)
    if device.type == "cpu":
        from pdserve.kernels import cpu_library

        cpu_library.load()
    log.info("TP rank %d of %d ready: %s", rank, cfg.tp_size, loaded.tp_layout.describe())
    # live weight updates: this rank's cut staged on a side thread, swapped in at rank 0's commit
    stager = ThreadPoolExecutor(1, thread_name_prefix="weights", initializer=serial_openmp)
    staging: Future[Copies] | None = None
    while True:
        head, payload = group.next_command()
        if head[0] == CMD_FORWARD:
            cmd = ForwardCommand.decode(head, payload)
            model(cmd.batch(page_size, device), pool, backend)
        elif head[0] == CMD_GATHER_KV:
            group.give_kv(pool.kv, payload)
        elif head[0] == CMD_SCATTER_KV:
            group.take_kv(pool.kv, payload)
        elif head[0] == CMD_SHARE_POOL:
            path, token = group.pool_segment()
            shape = pool_geometry(pool.kv)
            mapped = MappedPool.open(path, token, num_pages, shape, os.path.dirname(path), writable=True)
            used = min(max(head[2], 0), num_pages)
            mapped.pool[:used].copy_(pool.kv[:used])
            pool.kv = mapped.pool
            group.shared()
        elif head[0] == CMD_WEIGHTS_STAGE:  # in the background: forwards go on meanwhile
            shard = (loaded.tp_layout, rank, spec.head_dim)
            staging = stager.submit(stage_rank_cut, model, spec, group.staged_request(), shard)
        elif head[0] == CMD_WEIGHTS_COMMIT:
            copies, why = None, "rank 0 committed an update this rank was never asked to stage"
            if staging is not None:
                try:
                    copies, why = staging.result(), ""
                except Exception as exc:  # noqa: BLE001 - reported to rank 0, which refuses the commit
                    why = f"{type(exc).__name__}: {exc}"
            staging = None
            if why:
                group.say_failed(why)
            if group.failed_ranks(bool(why)) == 0 and copies is not None:
                apply(copies)
        elif head[0] == CMD_WEIGHTS_CANCEL:
            staging = None
        elif head[0] == CMD_STOP:
            return
        else:
            raise ValueError(f"TP rank {rank}: unknown command {head[0]}")


def main() -> None:
    logging.basicConfig(level=env.log_level().upper(), format="%(asctime)s %(name)s: %(message)s")
    folder, rank = sys.argv[1], int(sys.argv[2])
    try:
        follow(folder, rank)
    except TPGroupBroken as exc:
        log.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
