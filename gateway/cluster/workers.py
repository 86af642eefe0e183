"""The worker registry: who is registered, who is in rotation, and where the next request goes.

Plain bookkeeping, no sockets: `control.py` feeds it from the wire. A worker is in rotation when it
is registered and not draining; a draining worker still serves (and is pinged for) the requests it
holds. Routing follows `RoutingPolicy`, per role: `cache_aware` (default) picks the lowest
`cache_weight * uncached prompt tokens + load_weight * in-flight tokens`, the uncached tokens
counted on each worker's `PrefixIndex` (both roles keep a prefix cache: a decode worker that holds
a prompt's prefix receives only the pages after it); `least_load` picks the least outstanding work
the gateway tracks (in-flight requests, then in-flight tokens); `round_robin` ignores load and
cache alike. Ties go round-robin. A tensor-parallel worker's load counts per rank (divided by its
--tp-size): a worker split over two GPUs takes twice the work of one on a single GPU.

Conditional disaggregation (`prefill_locally`): when the part of a prompt the chosen decode worker
does not cache is shorter than `min_prefill_tokens`, or every prefill worker has more than
`max_prefill_queue` requests in flight, the decode worker computes the prompt itself.

A worker's state: `healthy` (in rotation), `draining`, or `down` (lost: heartbeat timeout). A lost
worker leaves the registry (never pinged, never routed to) but is remembered as down for
`DOWN_KEEP_S`, so operators see it; registering again under the same id, after it was lost or while
still listed (a restart the heartbeat had not noticed yet), counts as a restart. `stale_weights`: it
serves other weights than the cluster's (a failed update, a restart on the old checkpoint): out of
rotation until an update reaches it. `suspect`: the canaries (canary.py) saw its answers drift from
their reference: out of rotation until it registers again.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pdserve.gateway.cluster.clock import OffsetEstimator
from pdserve.gateway.cluster.prefix_index import PrefixIndex
from pdserve.gateway.config import POLICIES, Policy
from pdserve.protocol import compat
from pdserve.protocol.gateway import Register, Role

WorkerState = Literal["healthy", "draining", "down", "stale_weights", "suspect"]
# How long a lost worker stays listed as down unless it registers again.
DOWN_KEEP_S = 600.0


@dataclass
class WorkerInfo:
    worker_id: str
    role: Role
    identity: bytes  # zmq routing identity of the worker's DEALER socket
    reg: Register
    # Liveness times (liveness.LivenessClock: seconds the gateway's event loop was responsive): its last
    # frame, and the Ping sent when another connection claimed this id (`registration.refusal`).
    last_seen: float
    conflict_probe: float | None = None
    clock: OffsetEstimator = field(default_factory=OffsetEstimator)
    draining: bool = False
    # Load reported by the last Pong.
    queued: int = 0
    running: int = 0
    free_tokens: int = 0
    # Work the gateway has sent and not yet seen finished (prefill: until PrefillDone).
    inflight_requests: int = 0
    inflight_tokens: int = 0
    # Epoch seconds (gateway clock) of the last (re)registration.
    registered_at: float = field(default_factory=time.time)
    # Registrations under this id after the first one this gateway saw.
    restarts: int = 0
    down_since: float | None = None  # time.monotonic() when it was lost
    prefix: PrefixIndex = field(default_factory=PrefixIndex)  # what its prefix cache holds
    # The weights it serves (`Register`, then each committed update) and whether they are the cluster's:
    # a worker on other weights (a failed update, a restart on the old checkpoint) is out of rotation.
    weight_version: str = "default"
    stale_weights: bool = False
    # Why the canaries (gateway/autopilot/canary.py) took it out of rotation: its answers drifted from its pair's
    # reference. Until it registers again (a restart); None: not suspect.
    suspect: str | None = None
    # Speculative decoding on this (decode) worker, over the requests it finished: verify forwards and
    # the drafts they accepted.
    spec_verify_steps: int = 0
    spec_accepted_drafts: int = 0

    def count_spec(self, verify_steps: int, accepted_drafts: int) -> None:
        self.spec_verify_steps += verify_steps
        self.spec_accepted_drafts += accepted_drafts

    @property
    def avg_spec_accept_length(self) -> float | None:
        """Tokens per verify forward (the accepted drafts and the one token each forward adds), as
        SGLang reports it; None before any verify forward (speculation off)."""
        if not self.spec_verify_steps:
            return None
        return (self.spec_accepted_drafts + self.spec_verify_steps) / self.spec_verify_steps

    @property
    def bootstrap_addr(self) -> str:
        return self.reg.bootstrap_addr or ""

    @property
    def state(self) -> WorkerState:
        if self.down_since is not None:
            return "down"
        if self.stale_weights:
            return "stale_weights"
        if self.suspect is not None:
            return "suspect"
        return "draining" if self.draining else "healthy"


@dataclass(frozen=True)
class Limits:
    """The tightest limits over the workers in rotation."""

    context_length: int
    vocab_size: int
    # The most tokens (prompt + output) one request may hold on any decode worker's KV pool.
    decode_capacity: int


@dataclass(frozen=True)
class RoutingPolicy:
    prefill: Policy = "cache_aware"
    decode: Policy = "cache_aware"
    # cache_aware cost of a worker: cache_weight * uncached prompt tokens + load_weight * tokens it
    # has in flight. Equal weights: a cached token saves as much as a queued one costs.
    cache_weight: float = 1.0
    load_weight: float = 1.0
    # Conditional disaggregation (0: off): fewer uncached prompt tokens than this on the decode worker,
    # or more than this many requests in flight on every prefill worker, and the decode computes it.
    min_prefill_tokens: int = 0
    max_prefill_queue: int = 0

    def __post_init__(self) -> None:
        for role, p in (("prefill", self.prefill), ("decode", self.decode)):
            if p not in POLICIES:
                raise ValueError(f"{role} policy {p!r} is not one of {', '.join(POLICIES)}")
        if self.cache_weight < 0 or self.load_weight < 0:
            raise ValueError("routing weights must be >= 0")
        if self.min_prefill_tokens < 0 or self.max_prefill_queue < 0:
            raise ValueError("disaggregation thresholds must be >= 0")


class WorkerRegistry:
    def __init__(self, policy: RoutingPolicy | None = None) -> None:
        self.policy = policy or RoutingPolicy()
        self._workers: dict[str, WorkerInfo] = {}
        self._down: dict[str, WorkerInfo] = {}  # lost workers, kept for DOWN_KEEP_S
        self._rr: dict[str, int] = {"prefill": 0, "decode": 0}
        # The cluster's weight version (gateway/cluster/weights.py moves it at each committed update).
        self.weight_version = "default"

    # ---- membership --------------------------------------------------------------------------

    def check_fingerprint(self, reg: Register) -> str | None:
        """None when `reg` matches every registered worker; else a reason naming the differing fields,
        never their expected values (a refusal must not teach a stranger what to send next)."""
        for w in self._workers.values():
            if w.worker_id == reg.worker_id:
                continue
            diff, _allowed = compat.compare(reg.fingerprint, w.reg.fingerprint)  # compat.MAY_DIFFER: fine
            if diff:
                return f"model fingerprint mismatch in: {', '.join(diff)}"
        return None

    def add(self, reg: Register, identity: bytes, now: float, restart: bool = True) -> WorkerInfo:
        """Register `reg` (`now`: the liveness clock); the same id again (live or down) is a restart,
        unless `restart` is False (the same process in its new role: gateway/cluster/role_switch.py)."""
        before = self._workers.get(reg.worker_id) or self._down.pop(reg.worker_id, None)
        w = WorkerInfo(reg.worker_id, reg.role, identity, reg, last_seen=now)
        w.weight_version = reg.weight_version
        w.stale_weights = reg.weight_version != self.weight_version
        if before is not None:
            w.restarts = before.restarts + (1 if restart else 0)
        self._workers[reg.worker_id] = w
        return w

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def mark_down(self, worker_id: str, now_mono: float) -> WorkerInfo | None:
        """A lost worker: out of the registry (no pings, no routing), listed as down for a while."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            w.down_since = now_mono
            self._down[worker_id] = w
        return w

    def down(self, now_mono: float) -> list[WorkerInfo]:
        """Workers lost within DOWN_KEEP_S and not registered again; older ones are forgotten."""
        for wid, w in list(self._down.items()):
            if w.down_since is not None and now_mono - w.down_since > DOWN_KEEP_S:
                del self._down[wid]
        return list(self._down.values())

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def by_identity(self, identity: bytes) -> WorkerInfo | None:
        # A worker's identity is `worker_id/<random>` (pdserve.worker.link), or its bare id.
        w = self._workers.get(identity.decode(errors="replace").split("/", 1)[0])
        if w is not None and w.identity == identity:
            return w
        return next((w for w in self._workers.values() if w.identity == identity), None)

    def all(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def in_rotation(self, role: Role) -> list[WorkerInfo]:
        return sorted(
            (
                w
                for w in self._workers.values()
                if w.role == role and not w.draining and not w.stale_weights and w.suspect is None
            ),
            key=lambda w: w.worker_id,
        )

    def expired(self, now: float, timeout_s: float) -> list[WorkerInfo]:
        """Workers silent for more than `timeout_s` of liveness time (`now`: the liveness clock)."""
        return [w for w in self._workers.values() if now - w.last_seen > timeout_s]

    def healthy(self) -> bool:
        return bool(self.in_rotation("prefill")) and bool(self.in_rotation("decode"))

    def context_length(self) -> int | None:
        """The smallest context length of the workers in rotation (None without workers)."""
        limits = self.limits()
        return limits.context_length if limits else None

    def limits(self) -> Limits | None:
        live = self.in_rotation("prefill") + self.in_rotation("decode")
        if not live:
            return None
        decodes = self.in_rotation("decode")
        return Limits(
            context_length=min(w.reg.context_length for w in live),
            vocab_size=min(w.reg.vocab_size for w in live),
            decode_capacity=min((w.reg.max_total_tokens for w in decodes), default=0),
        )

    # ---- routing -----------------------------------------------------------------------------

    def pick(
        self,
        role: Role,
        avoid: Collection[str] = (),
        input_ids: Sequence[int] = (),
        hashes: dict[int, list[int]] | None = None,
    ) -> WorkerInfo | None:
        """The worker for the next request with prompt `input_ids`, by the role's policy; ties
        round-robin; never a worker id in `avoid` (a failed attempt's). `hashes`: the prompt's block
        hashes per page size, filled on first use, to share across the calls for one request. Does not
        reserve: call `acquire`."""
        cands = [w for w in self.in_rotation(role) if w.worker_id not in avoid]
        if not cands:
            return None
        policy = self.policy.prefill if role == "prefill" else self.policy.decode
        if policy == "round_robin":
            tied = cands
        elif policy == "cache_aware":
            a, b = self.policy.cache_weight, self.policy.load_weight
            hashes = {} if hashes is None else hashes
            costs = {
                w.worker_id: a * (len(input_ids) - w.prefix.cached_tokens(input_ids, hashes))
                + b * w.inflight_tokens / w.reg.tp_size
                for w in cands
            }
            low = min(costs.values())
            tied = [w for w in cands if costs[w.worker_id] == low]
            fewest = min(_per_rank_load(w)[0] for w in tied)
            tied = [w for w in tied if _per_rank_load(w)[0] == fewest]
        else:  # a TP worker's load counts per rank: a TP-2 worker on two GPUs takes twice the work
            best = min(_per_rank_load(w) for w in cands)
            tied = [w for w in cands if _per_rank_load(w) == best]
        w = tied[self._rr[role] % len(tied)]
        self._rr[role] += 1
        return w

    def prefill_locally(
        self,
        decode: WorkerInfo,
        input_ids: Sequence[int],
        prefills: Sequence[WorkerInfo],
        hashes: dict[int, list[int]] | None = None,
    ) -> bool:
        """Whether `decode` should compute this prompt itself (see the module docstring)."""
        p = self.policy
        if p.min_prefill_tokens > 0:
            uncached = len(input_ids) - decode.prefix.cached_tokens(
                input_ids, {} if hashes is None else hashes
            )
            if uncached < p.min_prefill_tokens:
                return True
        if p.max_prefill_queue > 0 and prefills:
            return all(w.inflight_requests > p.max_prefill_queue for w in prefills)
        return False

    @staticmethod
    def acquire(w: WorkerInfo, tokens: int) -> None:
        w.inflight_requests += 1
        w.inflight_tokens += tokens

    @staticmethod
    def release(w: WorkerInfo, tokens: int) -> None:
        w.inflight_requests = max(0, w.inflight_requests - 1)
        w.inflight_tokens = max(0, w.inflight_tokens - tokens)


def _per_rank_load(w: WorkerInfo) -> tuple[float, float]:
    """(in-flight requests, in-flight tokens) per rank of the worker's --tp-size."""
    return w.inflight_requests / w.reg.tp_size, w.inflight_tokens / w.reg.tp_size
