"""One decode step over the whole running batch: the interface, and the plain one-token stepper.

The offline engine and the decode node both step through this interface; the decode node's
speculative steppers (`pdserve.decode.speculative`) implement it too.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.protocol.records import RequestStats
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner, append_samples


class Stepper(Protocol):
    def step(self, reqs: list[Request]) -> None:
        """Advance every request by >= 1 token (appended to `output_ids`; finish rules applied)."""
        ...

    def stats(self, req: Request) -> RequestStats:
        """Per-request counters for meta_info (speculative statistics); {} when none."""
        ...

    def forget(self, req: Request) -> None: ...


class PlainStepper:
    """One forward, one token per request."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def step(self, reqs: list[Request]) -> None:
        logits = self.runner.forward(ForwardMode.DECODE, reqs, [[r.output_ids[-1]] for r in reqs])
        append_samples(reqs, self.runner.sample(reqs, logits))

    def stats(self, req: Request) -> RequestStats:
        return {}

    def forget(self, req: Request) -> None:
        pass
