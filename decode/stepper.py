"""One decode step over the whole running batch. Speculative steppers implement the same interface."""

from __future__ import annotations

from typing import Protocol

from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner, append_samples


class Stepper(Protocol):
    def step(self, reqs: list[Request]) -> None:
        """Advance every request by >= 1 token (appended to `output_ids`; finish rules applied)."""
        ...

    def stats(self, req: Request) -> dict:
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

    def stats(self, req: Request) -> dict:
        return {}

    def forget(self, req: Request) -> None:
        pass


def make_stepper(runner: ModelRunner) -> Stepper:
    if runner.cfg.speculative_algorithm is None or runner.cfg.speculative_num_draft_tokens == 0:
        return PlainStepper(runner)
    from pdserve.decode.speculative import SpeculativeStepper

    return SpeculativeStepper(runner)
