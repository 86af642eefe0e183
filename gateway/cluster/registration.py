"""Whether a Register is admitted: a worker speaks only for itself.

A worker is known by the zmq identity of the connection that registered it (a per-process
`worker_id/random` identity), so a Register for a worker id held by another live connection is refused
(retry later), as is a connection that registered under another id already, a worker whose model
fingerprint differs from the cluster's, and a prefill worker without a bootstrap address.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.gateway.config import GatewayConfig
from pdserve.protocol.gateway import Register

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    reason: str
    retry: bool = False  # the worker may try again (the id may come free)


def refusal(
    cfg: GatewayConfig,
    registry: WorkerRegistry,
    identity: bytes,
    reg: Register,
    now: float,
    ping: Callable[[WorkerInfo], None],
    switching: bool = False,
) -> Refusal | None:
    """Why the connection `identity` may not register as `reg` (None: it may). `now`: the liveness clock
    (liveness.py: a stall of the gateway's own does not make a live holder look gone);
    `ping` probes the live holder of the id claimed (see `_holder_gone`). `switching`: `reg` completes
    a role switch (its epoch is the one the gateway gave), so the id's old connection is the same
    process's, closed, and is not waited for."""
    old = registry.get(reg.worker_id)
    if (
        not switching
        and old is not None
        and old.identity != identity
        and now - old.last_seen <= cfg.heartbeat_timeout_s
        and not _holder_gone(cfg, old, now, ping)
    ):
        # Held by a live connection: a second process under the same id, or one trying to take
        # it over. A restarted worker gets in once the old connection has not answered a probe.
        log.warning("worker id %s is held by another live connection: register refused", reg.worker_id)
        return Refusal(f"worker id {reg.worker_id} is in use by another connection", retry=True)
    other = registry.by_identity(identity)
    if other is not None and other.worker_id != reg.worker_id:
        return Refusal(f"this connection is registered as {other.worker_id} already")
    reason = registry.check_fingerprint(reg)
    if reason is not None:
        log.error("refusing worker %s: %s", reg.worker_id, reason)
        return Refusal(reason)
    if reg.role == "prefill" and not reg.bootstrap_addr:
        return Refusal("a prefill worker must give bootstrap_addr")
    return None


def _holder_gone(cfg: GatewayConfig, old: WorkerInfo, now: float, ping: Callable[[WorkerInfo], None]) -> bool:
    """Another connection claims `old`'s id. The first claim pings the holder; a claim (the claimant
    retries every second) made when the holder has stayed silent for the probe window since that ping
    finds it gone: a restart, whose old process died without a word, gets its id back in about a
    second instead of a heartbeat timeout. A live holder answers, and the claim is refused again."""
    probe = old.conflict_probe
    window = min(cfg.heartbeat_timeout_s, max(1.0, 2 * cfg.heartbeat_interval_s))
    if probe is not None and old.last_seen < probe and now - probe >= window:
        log.info("worker %s did not answer a probe: a new connection takes its id", old.worker_id)
        return True
    if probe is None or old.last_seen >= probe:
        old.conflict_probe = now
        ping(old)
    return False
