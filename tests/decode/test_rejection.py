"""Rejection sampling preserves the target distribution at the first and second speculative position.

A tiny random target with a 16-token vocabulary, many seeded requests in one batch, k = 2 drafts
forced. Every request starts after the same prompt and the same first token, so position 1 must
follow p(. | prompt, t0) and position 2 the marginal sum_x p(x | prompt, t0) p(. | prompt, t0, x).
Both are computed exactly from the model and compared with a chi-square goodness-of-fit test.
The seeds are fixed, so the test is deterministic (not flaky); a biased acceptance rule (e.g.
always accepting, or accepting with p instead of p / q) fails it by a wide margin.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.config import RuntimeConfig
from pdserve.decode.drafters import DraftModelDrafter, NgramDrafter
from pdserve.decode.speculative import FixedPolicy, SpeculativeStepper
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.loader import load_model
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner
from pdserve.runtime.sampling_batch import SamplingBatch
from pdserve.sampling_params import SamplingParams

VOCAB = 16
N = 4000
PROMPT = [3, 5, 7, 14, 3, 5]
T0 = 7  # the "prefill" token; NGRAM then proposes 14, 3 (what followed "3 5 7" before)
P_MIN = 1e-3


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("vocab16")
    target = tiny_llama(str(root / "target"), vocab=VOCAB, seed=3, sharpness=1.5)
    draft = tiny_llama(str(root / "draft"), vocab=VOCAB, seed=4, sharpness=1.5)
    return load_model(target, "float32", "cpu"), load_model(draft, "float32", "cpu")


def make_runner(loaded) -> ModelRunner:
    cfg = RuntimeConfig(
        device="cpu", page_size=16, max_total_tokens=16 * (N + 8), attention_backend="torch", num_threads=1
    )
    return ModelRunner(cfg, loaded)


def exact_probs(runner: ModelRunner, sp: SamplingParams, contexts: list[list[int]]) -> torch.Tensor:
    """[len(contexts), V] the sampler's distribution after each context (one extend forward)."""
    reqs = [Request(f"x{i}", c, sp) for i, c in enumerate(contexts)]
    for r in reqs:
        assert runner.reserve(r, len(r.prompt_ids))
    logits = runner.forward(ForwardMode.EXTEND, reqs, [r.prompt_ids for r in reqs])
    probs = runner.sampler.probs(logits, SamplingBatch.build([sp] * len(reqs)), None, None)
    for r in reqs:
        runner.release(r)
    return probs.double()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5  # pool rare bins so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def run_speculative(runner: ModelRunner, stepper: SpeculativeStepper, sp: SamplingParams) -> list[Request]:
    reqs = [Request(f"r{i}", list(PROMPT), sp.model_copy(update={"seed": 1000 + i})) for i in range(N)]
    for r in reqs:
        assert runner.reserve(r, r.max_total_tokens)
    runner.forward(ForwardMode.EXTEND, reqs, [r.prompt_ids for r in reqs])
    for r in reqs:
        r.append_token(T0)  # as if sampled on the prefill node
        r.state = RequestState.RUNNING
    running = list(reqs)
    while running:
        stepper.step(running)
        running = [r for r in running if not r.finished]
    return reqs


@pytest.mark.parametrize(
    "algorithm, sp",
    [
        ("STANDALONE", SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)),
        ("NGRAM", SamplingParams(max_new_tokens=4, temperature=0.8, top_k=12, ignore_eos=True)),
    ],
)
def test_sampled_acceptance_preserves_target_distribution(tiny_models, algorithm, sp):
    target, draft = tiny_models
    runner = make_runner(target)
    drafter = DraftModelDrafter(runner, loaded=draft) if algorithm == "STANDALONE" else NgramDrafter()
    stepper = SpeculativeStepper(runner, drafter, FixedPolicy(), num_draft_tokens=2)
    reqs = run_speculative(runner, stepper, sp)

    stats = [stepper.stats(r) for r in reqs]
    first_step = sum(s["spec_num_proposed_drafts"] for s in stats)
    accepted = sum(s["spec_num_correct_drafts"] for s in stats)
    assert first_step >= 2 * N  # the first step drafts 2 for everyone
    assert 0.05 * first_step < accepted < 0.95 * first_step  # both outcomes are exercised
    for r in reqs:
        stepper.forget(r)
        runner.release(r)

    p1 = exact_probs(runner, sp, [PROMPT + [T0]])[0]  # [V]
    p2_given = exact_probs(runner, sp, [PROMPT + [T0, x] for x in range(VOCAB)])  # [V, V]
    p2 = p1 @ p2_given  # [V]
    out1 = torch.bincount(torch.tensor([r.output_ids[1] for r in reqs]), minlength=VOCAB).double()
    out2 = torch.bincount(torch.tensor([r.output_ids[2] for r in reqs]), minlength=VOCAB).double()
    assert chi_square_p(out1, p1) > P_MIN, (out1 / N, p1)
    assert chi_square_p(out2, p2) > P_MIN, (out2 / N, p2)
    # The test has power: the draft's own distribution (or a point mass at the NGRAM draft) is
    # far from the target's, so always accepting would be rejected.
    if algorithm == "STANDALONE":
        q1 = exact_probs(make_runner(draft), sp, [PROMPT + [T0]])[0]
    else:
        q1 = torch.zeros(VOCAB, dtype=torch.float64).index_fill_(0, torch.tensor([14]), 1.0)
    assert chi_square_p(q1 * N + 1e-9, p1) < P_MIN
