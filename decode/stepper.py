"""The decode node's stepper: plain (from runtime) or speculative, chosen by the configuration."""

from __future__ import annotations

from pdserve.runtime.runner import ModelRunner
from pdserve.runtime.stepper import PlainStepper, Stepper

__all__ = ["PlainStepper", "Stepper", "make_stepper"]


def make_stepper(runner: ModelRunner) -> Stepper:
    if runner.cfg.speculative_algorithm is None or runner.cfg.speculative_num_draft_tokens == 0:
        return PlainStepper(runner)
    from pdserve.decode.speculative import SpeculativeStepper

    return SpeculativeStepper(runner)
