"""Running a generation again on another pair after one of its legs failed for reasons outside the request.

A leg lost, draining, or a failed KV transfer (`AGAIN_CODES`) ends the attempt with `TryAgain`; the
generation goes on under a new room id. Before the client may have seen a token that is a retry (at
most one); after, a migration (at most `MAX_MIGRATIONS`). Either way the new pair gets the prompt plus
the tokens produced so far (a retry's: at most the first token, which PrefillDone brought) and the
remaining `max_new_tokens`, and the same `GenState` and `Collector` (detokenizer and stop-string state)
carry on, so the client sees one stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.gateway.cluster.rooms import LegFailed, Room
from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation.routing import candidates
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.protocol.vocabulary import FailCode

log = logging.getLogger(__name__)

# Failures that say nothing about the request itself: worth running again on another pair (the
# client does not notice). A failed or corrupt KV transfer: the KV never reached this decode worker intact;
# another may get it.
AGAIN_CODES = frozenset({FailCode.WORKER_LOST, FailCode.DRAINING, FailCode.TRANSFER, FailCode.KV_CORRUPT})
# A request that keeps landing on failing workers ends after this many migrations.
MAX_MIGRATIONS = 2


class TryAgain(Exception):
    """An attempt's leg failed with one of `AGAIN_CODES`; `Attempts.again` decides whether to go on."""

    def __init__(self, ev: LegFailed, room: Room, error: ApiError) -> None:
        super().__init__(error.message)
        self.code, self.error = ev.code, error
        prefill = room.prefill.worker_id if room.prefill is not None else ""  # "": a local prefill
        decode = room.decode.worker_id if room.decode is not None else ""  # "": prefill only
        self.failed = prefill if ev.role == "prefill" else decode
        self.prefill, self.decode = prefill, decode
        # A transfer that failed before the prefill finished the prompt, while others waited in that
        # prefill worker's queue besides it: the decode gave up waiting behind an overloaded prefill (its
        # `--waiting-timeout`), not on a broken link. The queue's length then, else 0.
        self.prefill_queued = 0
        if ev.code in (FailCode.TRANSFER, FailCode.KV_CORRUPT) and room.prefill is not None:
            if room.prefill_done is None and room.prefill.queued > 1:
                self.prefill_queued = room.prefill.queued


@dataclass
class Attempts:
    """What one generation's attempts taught: the workers to stay away from, and how often it went again."""

    rid: str
    stream: bool  # the client sees each token as it comes
    avoid: set[str] = field(default_factory=set)  # workers that failed an attempt: never again
    prefer_not: set[str] = field(default_factory=set)  # used again only when there is no other
    retries: int = 0
    migrations: int = 0
    # A decode leg sent tokens (a first token from PrefillDone alone does not count).
    decoded: bool = False

    def again(self, a: TryAgain, produced: int, registry: WorkerRegistry, metrics: GatewayMetrics) -> None:
        """After `produced` tokens: count a retry or a migration and mark the workers to avoid, or raise
        the failure."""
        # A retry until the client may have seen a token: a stream's first one (which PrefillDone brings
        # before the decode has the KV), or any decoded one. Either way the next attempt goes on from the
        # tokens produced so far.
        retry = produced == 0 or (not self.stream and not self.decoded)
        if retry and self.retries >= 1:
            raise a.error
        if not retry and self.migrations >= MAX_MIGRATIONS:
            raise ApiError(
                a.error.status, f"{a.error.message} (not migrated: already migrated {self.migrations} times)"
            )
        avoid, prefer_not = set(self.avoid), set(self.prefer_not)
        if a.code in (FailCode.TRANSFER, FailCode.KV_CORRUPT):
            # Either side may be at fault: another decode worker always, another prefill if there is one.
            avoid.add(a.decode)
            if a.prefill_queued:
                # Behind an overloaded prefill: the same queue again would only add to it (under
                # overload a retry is more load). Another prefill worker or none.
                avoid.add(a.prefill)
            elif a.prefill:
                prefer_not.add(a.prefill)
        else:
            avoid.add(a.failed)
        missing = [r for r in ("prefill", "decode") if not candidates(registry, r, avoid)]
        if missing:
            what = "retried" if retry else "migrated"
            why = f"no other {' and no other '.join(missing)} worker in rotation"
            if a.prefill_queued and "prefill" in missing:
                why = (
                    f"the prompt was still waiting on prefill worker {a.prefill}, {a.prefill_queued} "
                    "requests queued there, and there is no other prefill worker in rotation"
                )
                metrics.retries_withheld.inc()
            raise ApiError(a.error.status, f"{a.error.message} (not {what}: {why})")
        self.avoid, self.prefer_not = avoid, prefer_not
        if retry:
            self.retries += 1
            metrics.retries.inc()
            log.warning("request %s: retrying on another pair after: %s", self.rid, a.error.message)
        else:
            self.migrations += 1
            metrics.migrations.inc()
            log.warning(
                "request %s: migrating after %d tokens to another pair after: %s",
                self.rid,
                produced,
                a.error.message,
            )
