"""A request can fail, a worker cannot: what a worker loop does when its work for requests raises.

An exception raised while a worker computes for a batch (a forward, sampling, prompt logprobs, a
first token arriving) fails the requests it was raised for, with code `internal`, through the
paths aborts and deadlines use; the process goes on. `StepFaults.triage` names them: each request
of the batch is checked alone on the CPU (`probe`: its token ids within the vocabulary, its sampling
parameters through the real sampler on one row of zero logits), and those that fail alone are the
culprits. When none does, nothing tells the batch's requests apart: all of them fail.

Failures no request explains, in a row with no successful forward between them, say the worker
itself is broken (a device fault, its own state corrupt): after `BLIND_FAILURE_LIMIT` of them the
worker raises `StepFailed`, exits non-zero and its supervisor restarts it, as it does for a dead KV
engine. A probe runs on the CPU so that a broken device cannot make every request look guilty.

`Progress` snapshots what a step advances on each request, so that the requests that were not
failed go on from where they were (their KV is computed again). An exception while a worker handles
a gateway message fails the request it admits, or is logged (`StepFaults.guard_message`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.protocol import gateway as m
from pdserve.runtime.request import Request
from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sampling_batch import SamplingBatch

log = logging.getLogger(__name__)

# Consecutive unexplained step failures (no successful forward between them) before the worker
# gives up and exits for a restart. Requests that fail alone never count.
BLIND_FAILURE_LIMIT = 8


class StepFailed(RuntimeError):
    """The worker's steps keep failing for no request in particular: the process should restart."""


def probe(r: Request, vocab_size: int) -> str | None:
    """Why `r` alone cannot be computed (a short reason), or None. Side-effect free: the sampler
    runs on a copy, on the CPU."""
    try:
        bad = next((t for t in (*r.prompt_ids, *r.output_ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"token id {bad} outside the vocabulary of {vocab_size}"
        alone = copy.copy(r)
        alone.output_ids = list(r.output_ids)
        sb = SamplingBatch.build([r.params], "cpu", [r.eos_token_ids], vocab_size)
        logits = torch.zeros(1, vocab_size)
        Sampler()(logits, sb, [r.prompt_ids], [alone.output_ids], [len(r.output_ids)])
    except Exception as exc:  # noqa: BLE001 - any exception names the culprit
        return type(exc).__name__
    return None


@dataclass
class Progress:
    """What a step may advance on one request: restored on the requests a failed step spares."""

    num_computed: int
    outputs: int
    input_logprobs: int
    input_top_logprobs: int

    @classmethod
    def of(cls, reqs: list[Request]) -> dict[str, Progress]:
        return {
            r.room: cls(r.num_computed, len(r.output_ids), len(r.input_logprobs), len(r.input_top_logprobs))
            for r in reqs
        }

    def sampled(self, r: Request) -> bool:
        """The step appended a token to `r` before it failed (its grammar accepted it): keep it."""
        return len(r.output_ids) > self.outputs

    def restore(self, r: Request) -> None:
        """Back to before the step, the step's token aside (see `sampled`): its KV is computed again."""
        if not self.sampled(r):
            r.num_computed = self.num_computed
        del r.input_logprobs[self.input_logprobs :]
        del r.input_top_logprobs[self.input_top_logprobs :]


class StepFaults:
    """One worker's record of failed steps; see the module docstring."""

    def __init__(self, worker_id: str, role: str, vocab_size: int, limit: int = BLIND_FAILURE_LIMIT) -> None:
        self.worker_id, self.role, self.vocab_size, self.limit = worker_id, role, vocab_size, limit
        self.blind = 0  # unexplained failures since the last successful forward

    def ok(self) -> None:
        """A forward (and its sampling) succeeded: the worker works."""
        self.blind = 0

    def message(self, exc: BaseException) -> str:
        """What the client is told: the worker and the exception's type, never a traceback."""
        return (
            f"internal error on {self.role} worker {self.worker_id} ({type(exc).__name__}); "
            "the request failed, the worker goes on"
        )

    def triage(self, exc: BaseException, reqs: list[Request], what: str) -> list[Request]:
        """Log `exc` once (with its traceback) and return the requests of the failed batch to fail:
        those that fail alone, or all of them. Raises StepFailed past the limit of unexplained ones."""
        reasons = {r.room: probe(r, self.vocab_size) for r in reqs}
        culprits = [r for r in reqs if reasons[r.room] is not None]
        named = ", ".join(f"{r.room} ({reasons[r.room]})" for r in culprits) or "none found alone"
        log.error(
            "%s of %d requests failed (%s); failing: %s",
            what,
            len(reqs),
            type(exc).__name__,
            named if culprits else f"all ({named})",
            exc_info=exc,
        )
        if culprits:
            return culprits
        self.blind += 1
        if self.blind >= self.limit:
            raise StepFailed(
                f"{self.blind} steps in a row failed for no request in particular, the last with "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return list(reqs)

    def lone(self, exc: BaseException, room: str, what: str) -> None:
        """Log the failure of work for one request (its culprit is known)."""
        log.error("%s for %s failed (%s); failing it", what, room, type(exc).__name__, exc_info=exc)

    def guard_message(
        self, handle: Callable[[m.Message], None], msg: m.Message, fail: Callable[[str, Exception], None]
    ) -> None:
        """`handle(msg)`; an exception while admitting a request fails that request alone
        (`fail(room, exc)`), one while handling any other message is logged."""
        try:
            handle(msg)
        except Exception as exc:  # noqa: BLE001 - a request fails, never the worker
            if not isinstance(msg, m.GenerateRequest):
                log.error("handling a %s message failed", msg.kind, exc_info=exc)
                return
            self.lone(exc, msg.room, "admitting a request")
            fail(msg.room, exc)
