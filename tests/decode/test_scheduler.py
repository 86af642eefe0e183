"""The decode node's page policy: retraction under pool pressure, resumption by recomputation."""

from __future__ import annotations

import pytest

from pdserve.config import RuntimeConfig
from pdserve.decode.scheduler import DecodeScheduler
from pdserve.decode.stepper import PlainStepper
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner, append_samples
from pdserve.sampling_params import SamplingParams

PROMPTS = [[504, 3575, 282, 4649, 314], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9999, 123, 77], [42] * 20]


def run_to_completion(runner: ModelRunner, sched: DecodeScheduler, reqs: list[Request]) -> int:
    """Drive the scheduler like the decode worker, with the prompt KV computed locally instead of
    received (the transfer is not what this test is about). Returns how many retractions happened."""
    stepper = PlainStepper(runner)
    sched.pending.extend(reqs)
    retractions = 0
    for _ in range(2000):
        sched.resume_retracted()
        for r in sched.admit():
            # Stands in for the KV transfer: the prompt's KV is computed here, into the pages admitted.
            del sched.transferring[r.rid]
            logits = runner.forward(ForwardMode.EXTEND, [r], [r.prompt_ids])
            append_samples([r], runner.sample([r], logits))
            r.state = RequestState.RUNNING
            sched.running.append(r)
        retractions += len(sched.grow_or_retract())
        if sched.running:
            stepper.step(sched.running)
        sched.retire_finished()
        runner.allocator.check_invariants()
        if not len(sched):
            return retractions
    raise AssertionError("the scheduler did not finish the work")


@pytest.mark.timeout(900)
def test_small_pool_retracts_resumes_and_matches_engine(bundled, make_engine):
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    ref = [o.output_ids for o in make_engine(bundled).generate(PROMPTS, params)]

    # 14 pages of 16 tokens: each request needs 5 pages over its life; the four together need 20.
    runner = ModelRunner(
        RuntimeConfig(device="cpu", max_total_tokens=224, page_size=16, attention_backend="torch"), bundled
    )
    sched = DecodeScheduler(runner, max_running=8, lookahead=1)
    reqs = [Request(f"r{i}", p, params, runner.spec.eos_token_ids) for i, p in enumerate(PROMPTS)]
    retractions = run_to_completion(runner, sched, reqs)

    assert retractions > 0
    assert sum(r.num_retractions for r in reqs) == retractions
    for r, expected in zip(reqs, ref):
        assert r.output_ids == expected, r.rid
    assert runner.allocator.num_free == runner.allocator.num_pages
