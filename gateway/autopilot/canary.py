"""Canaries: a live cluster that starts to answer wrong is noticed, and the pair's workers leave rotation.

With `--canary-interval S` the gateway asks every (prefill, decode) pair in rotation, every S seconds,
one fixed greedy request (CANARY_PROMPT, CANARY_TOKENS tokens, logprobs with the two best alternatives),
pinned to that pair (`GenInput.pinned`). A pair's first answer, computed with the prefix cache off on
both legs, is its reference; a new pair's reference must also agree with the references the other pairs
already hold. Each later answer (cache on: it also reads what the canaries cached) is compared with the
reference (`differs`): a token that differs, unless the reference's two best tokens there were within
`tolerance` nats of each other (a near tie that batch composition may flip: the rest is not compared),
or a logprob that moved more than `tolerance`, is a mismatch.

After each round, a worker in a pair that mismatched and in no pair that agreed is suspect: out of
rotation (`state: suspect` in /workers) until it registers again, with an error logged naming both
answers, and `pdserve_canary_mismatches_total` counted. With one worker of a role both sides of a bad
pair are suspect: the cluster then refuses requests rather than answer them wrong.

Canaries run through a `Generations` of their own, with its own metrics: they never count in the
user's metrics, the dashboard or traces. The workers do serve them (their own /metrics count them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation.generation import Generations, GenInput
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CANARY_PROMPT = "Count from one to twenty in English words, separated by commas: one, two,"
CANARY_TOKENS = 8
TOLERANCE = 0.5  # nats: near ties in the reference, and how far a logprob may move


@dataclass(frozen=True)
class Answer:
    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # the two best (token, logprob) at each position


def differs(ref: Answer, got: Answer, tolerance: float = TOLERANCE) -> str | None:
    """Why `got` is not `ref`'s answer, or None."""
    for i, (want, have) in enumerate(zip(ref.ids, got.ids)):
        if want != have:
            best = dict(ref.top[i]) if i < len(ref.top) else {}
            if have in best and best.get(want, ref.logprobs[i]) - best[have] <= tolerance:
                return None  # a near tie in the reference: what follows is another continuation
            return f"token {i} is {have}, the reference's is {want}"
        if i < len(got.logprobs) and abs(ref.logprobs[i] - got.logprobs[i]) > tolerance:
            return f"token {i}'s logprob is {got.logprobs[i]:.3f}, the reference's {ref.logprobs[i]:.3f}"
    if len(ref.ids) != len(got.ids):
        return f"{len(got.ids)} tokens, the reference has {len(ref.ids)}"
    return None


PairKey = tuple[str, float, str, float]  # prefill id and registration time, decode id and registration time


class Canaries:
    """The gateway's canary loop (`run`), over the registry's pairs in rotation."""

    def __init__(
        self,
        interval_s: float,
        generations: Generations,
        registry: WorkerRegistry,
        metrics: GatewayMetrics,
        prompt_ids: list[int],
        tolerance: float = TOLERANCE,
    ) -> None:
        self.interval_s, self.generations, self.registry = interval_s, generations, registry
        self.metrics, self.prompt_ids, self.tolerance = metrics, prompt_ids, tolerance
        self.references: dict[PairKey, Answer] = {}

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - a round that failed is logged; the next one comes
                log.exception("canary round failed")
            await asyncio.sleep(self.interval_s)

    async def check(self) -> None:
        """One round: every pair in rotation answers once; suspects leave rotation."""
        results: dict[tuple[str, str], str | None] = {}  # (prefill id, decode id) -> why it mismatched
        members: dict[str, WorkerInfo] = {}
        for p in self.registry.in_rotation("prefill"):
            for d in self.registry.in_rotation("decode"):
                key = (p.worker_id, p.registered_at, d.worker_id, d.registered_at)
                ref = self.references.get(key)
                why: str | None
                got = await self._ask(p, d, use_prefix_cache=ref is not None)
                if got is None:
                    continue
                members[p.worker_id], members[d.worker_id] = p, d
                if ref is None:  # the pair's first answer: it must agree with the other pairs' references
                    others = (a for k, a in self.references.items() if (k[0], k[2]) != (key[0], key[2]))
                    against = next(((a, w) for a in others if (w := differs(a, got, self.tolerance))), None)
                    if against is None:
                        self.references[key] = got
                        results[(p.worker_id, d.worker_id)] = None
                        continue
                    ref, why = against[0], f"its first answer disagrees with another pair's: {against[1]}"
                else:
                    why = differs(ref, got, self.tolerance)
                results[(p.worker_id, d.worker_id)] = why
                if why is not None:
                    self._mismatch(p, d, ref, got, why)
        self._blame(results, members)

    async def _ask(self, p: WorkerInfo, d: WorkerInfo, use_prefix_cache: bool) -> Answer | None:
        sampling = SamplingParams(
            max_new_tokens=CANARY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs_num=2
        )
        inp = GenInput(
            rid=f"canary-{time.monotonic_ns()}",
            input_ids=self.prompt_ids,
            sampling=sampling,
            max_new_tokens_given=True,
            received_ts=time.time(),
            pinned=(p.worker_id, d.worker_id),
            use_prefix_cache=use_prefix_cache,
        )
        final = None
        try:
            async for st in self.generations.generate(inp):
                final = st
        except ApiError as e:  # the pair failed the request: not a wrong answer (its own failure paths)
            log.warning("canary on %s -> %s failed: %s", p.worker_id, d.worker_id, e.message)
            self.metrics.canaries.labels("error").inc()
            return None
        assert final is not None and final.finished
        self.metrics.canaries.labels("answered").inc()
        return Answer(list(final.output_ids), list(final.logprobs), [list(t) for t in final.top_logprobs])

    def _mismatch(self, p: WorkerInfo, d: WorkerInfo, ref: Answer, got: Answer, why: str) -> None:
        self.metrics.canary_mismatches.labels(p.worker_id, d.worker_id).inc()
        log.error(
            "canary: pair %s -> %s answered %s where its reference is %s (%s)",
            p.worker_id,
            d.worker_id,
            got.ids,
            ref.ids,
            why,
        )

    @staticmethod
    def _blame(results: dict[tuple[str, str], str | None], members: dict[str, WorkerInfo]) -> None:
        """Workers in a pair that mismatched and in none that agreed leave rotation."""
        good = {wid for pair, why in results.items() if why is None for wid in pair}
        for (p, d), why in results.items():
            for wid in (p, d):
                w = members[wid]
                if why is not None and wid not in good and w.suspect is None:
                    w.suspect = f"canary mismatch on {p} -> {d}: {why}"
                    log.error("canary: %s is suspect, out of rotation: %s", wid, w.suspect)
