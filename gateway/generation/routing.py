"""Where one attempt of a generation runs: a prefill and a decode worker, or one of them alone.

The decode worker is picked first (its prefix cache decides whether the prompt is computed there);
the prefill worker is picked by the registry's policy (workers.py), away from those that failed the
generation before.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from enum import StrEnum

from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.gateway.errors import ApiError
from pdserve.protocol.gateway import Role
from pdserve.sampling_params import SamplingParams


class RouteWhy(StrEnum):
    PAIR = "pair"  # a prefill worker computes the prompt and hands its KV to the decode worker
    # Conditional disaggregation: the decode worker computes a short uncached prompt itself.
    LOCAL_PREFILL = "local prefill"
    # Nothing to decode past the prefill's first token (max_new_tokens 1), or at all (0: prompt
    # logprobs, a cache warm-up): the answer is PrefillDone's, and no KV moves.
    PREFILL_ONLY = "prefill only"


@dataclass(frozen=True)
class Route:
    prefill: WorkerInfo | None  # None: a local prefill
    decode: WorkerInfo | None  # None: prefill only
    why: RouteWhy


def candidates(registry: WorkerRegistry, role: Role, avoid: Set[str]) -> list[WorkerInfo]:
    return [w for w in registry.in_rotation(role) if w.worker_id not in avoid]


def pinned_route(registry: WorkerRegistry, prefill_id: str, decode_id: str) -> Route:
    """Exactly this pair, in rotation (a canary's); 503 otherwise."""
    prefill, decode = registry.get(prefill_id), registry.get(decode_id)
    if prefill is None or decode is None or prefill.state != "healthy" or decode.state != "healthy":
        raise ApiError(503, f"the pair {prefill_id} -> {decode_id} is not in rotation")
    return Route(prefill, decode, RouteWhy.PAIR)


def route(
    registry: WorkerRegistry,
    prompt: list[int],
    sampling: SamplingParams,
    avoid: Set[str],
    prefer_not: Set[str],
) -> Route:
    """The workers for an attempt at `prompt`, never one in `avoid`, one in `prefer_not` only when there
    is no other prefill worker. 503 when a role has no worker left."""
    hashes: dict[int, list[int]] = {}  # the prompt's block hashes, computed once for all three
    prefill_only = sampling.max_new_tokens <= 1
    decode = None if prefill_only else registry.pick("decode", avoid, prompt, hashes)
    # Prompt logprobs come from a prefill worker.
    local = (
        decode is not None
        and sampling.logprob_start_len < 0
        and registry.prefill_locally(decode, prompt, candidates(registry, "prefill", avoid), hashes)
    )
    prefill = None
    if not local:
        prefill = registry.pick("prefill", avoid | prefer_not, prompt, hashes) or registry.pick(
            "prefill", avoid, prompt, hashes
        )
    if (prefill is None and not local) or (decode is None and not prefill_only):
        missing = " and no ".join(
            r for r, w in (("prefill", prefill or local), ("decode", decode or prefill_only)) if not w
        )
        retry = " to retry on" if avoid else ""
        raise ApiError(503, f"no {missing} worker in rotation{retry}", headers={"Retry-After": "1"})
    why = RouteWhy.PREFILL_ONLY if prefill_only else RouteWhy.LOCAL_PREFILL if local else RouteWhy.PAIR
    return Route(prefill, decode, why)
