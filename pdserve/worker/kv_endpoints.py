"""A worker's end of the KV hand-off, built from its runner: where its pools live and what the peers
are offered (the one place the workers and the tests wire a runner to kv_transfer).

On CPU with shared memory allowed (`--kv-transport` auto or shm) a prefill worker's pools move into
segments that same-host decode nodes map; a TP worker's ranks each have their own, and a decode worker
of TP > 1 shares its ranks' pools with its rank 0 too. A same-host hand-off then copies each decode
rank's KV heads straight from the prefill rank that holds them; the pair group (another host, or
`--kv-transport dist`) carries every head from and to rank 0's full-head pool (runtime/runner.py
`before_send` / `after_receive`).
"""

from __future__ import annotations

import logging

from pdserve.kv_transfer import KVReceiver, KVSender, TransferConfig
from pdserve.kv_transfer.shm import SharedSegment, ShmError
from pdserve.runtime.runner import ModelRunner
from pdserve.worker.test_hooks import TestHooks

log = logging.getLogger(__name__)


def _share(runner: ModelRunner, config: TransferConfig) -> list[SharedSegment]:
    if config.transport == "dist" or runner.transfer_kv.is_cuda:
        return []
    try:
        return runner.share_pools(config.shm_dir)
    except ShmError as exc:
        log.warning("KV pools not in shared memory, every transfer uses the pair group: %s", exc)
        return []


def sender_for(
    runner: ModelRunner, host: str, port: int, config: TransferConfig, hooks: TestHooks | None = None
) -> KVSender:
    """A prefill worker's sender (not started), with the KV test hooks that are set."""
    segments = _share(runner, config)
    ranks = runner.rank_kv is not None
    make = KVSender if hooks is None else hooks.sender
    return make(
        runner.transfer_kv,
        runner.fingerprint(),
        host,
        port,
        config,
        segment=segments[0] if segments and not ranks else None,
        tp_size=runner.tp_size,
        rank_segments=segments if ranks else None,
        # the pair group sends every head from rank 0's full-head pool, gathered per room as it goes
        prepare=runner.before_send if ranks else None,
        owns_segment=False,  # the runner removes it (`close`): a role switch builds a new sender on it
    )


def receiver_for(runner: ModelRunner, config: TransferConfig) -> KVReceiver:
    """A decode worker's receiver (not started)."""
    # A TP worker's rank 0 then writes each rank's heads straight into its pool (one process: no need).
    runner.tp.share_rank_pools(lambda: _share(runner, config))
    return KVReceiver(
        runner.transfer_kv,
        runner.fingerprint(),
        config,
        tp_size=runner.tp_size,
        rank_pools=runner.rank_kv,
    )
