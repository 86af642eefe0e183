"""The ranks 1..N-1 of a tensor-parallel worker: each loads its part of the model, builds its own KV pool
(its KV heads of the same pages as rank 0's) and runs whatever forward rank 0 describes, in lockstep.

Rank 0 (runtime/runner.py) starts them with `spawn_followers`, as children that die with it (the
launchers' `die_with`, PR_SET_PDEATHSIG):
a worker is one unit, whichever of its processes dies. A follower that loses its group exits non-zero,
and rank 0 sees the broken group at its next operation (runtime/tp_group.py TPGroupBroken).

    python -m pdserve.runtime.tp_follower <folder> <rank>

`folder` is rank 0's private rendezvous folder: the FileStore and config.json (the RuntimeConfig), and
`owner`, rank 0's pid and start time. A rank 0 killed with SIGKILL never removes its folder (nor, before
every rank mapped it, its /dev/shm segment): the next rank 0 to start sweeps those whose owner is dead
(`sweep_stale_tp_folders`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import secrets
import shutil
import stat
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

PREFIX = "pdserve-tp-"  # rank 0's rendezvous folder in the temp folder, and its segment in /dev/shm
OWNER_FILE = "owner"  # in the folder: "<pid> <start time>" of rank 0


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
    sweep_stale_tp_folders()
    folder = tempfile.mkdtemp(prefix=PREFIX)  # mode 0700: only this user meets there
    with open(os.path.join(folder, OWNER_FILE), "w") as f:
        f.write(owner_record())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    segment = ""
    if rank_device(cfg, 0).type == "cpu" and env.tp_shm_allreduce() and os.path.isdir("/dev/shm"):
        segment = f"/dev/shm/{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    with open(os.path.join(folder, "allreduce"), "w") as f:
        f.write(segment)  # named before it exists: the sweep finds every segment through its folder
    if segment:
        make_segment(segment, cfg.tp_size)  # unlinked by rank 0 once every rank has mapped it
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
        if os.path.basename(segment).startswith(PREFIX):  # nothing else, whatever the file says
            os.unlink(segment)
    except FileNotFoundError:
        pass
    shutil.rmtree(folder, ignore_errors=True)


def process_start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat, clock ticks since boot): with the
    pid, it names one process, not a later one given the same pid. None where no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        return fields[19]
    except (OSError, IndexError):
        return None


def owner_record() -> str:
    """This process, as its rendezvous folder's `owner` file names it: pid, start time, pid namespace."""
    return f"{os.getpid()} {process_start_time(os.getpid())} {_pid_namespace()}"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _owner_alive(folder: str) -> bool | None:
    """Whether the rank 0 that made `folder` still runs; None where that cannot be told: the folder names
    no owner (an older pdserve's, or its owner is writing it right now) or one of another pid namespace
    (a container sharing this temp folder, whose processes this one cannot see)."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            pid, start, namespace = f.read().split()
    except (OSError, ValueError):
        return None
    if namespace != _pid_namespace() or not pid.isdigit():
        return None
    return process_start_time(int(pid)) == start


def sweep_stale_tp_folders(tmp: str | None = None) -> list[str]:
    """Remove this user's rendezvous folders in `tmp` (default: the temp folder) whose rank 0 is dead, with
    the /dev/shm segment each names (a rank 0 killed before every rank had mapped it leaves it there);
    never one of a live process, of another user or of another pid namespace. Returns what it removed."""
    removed = []
    for folder in glob.glob(os.path.join(tmp or tempfile.gettempdir(), PREFIX + "*")):
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _owner_alive(folder) is False:
            discard_tp_folder(folder)
            removed.append(folder)
    if removed:
        log.info("removed what killed TP workers left: %s", ", ".join(removed))
    return removed


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
