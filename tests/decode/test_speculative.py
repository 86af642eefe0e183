"""Speculative decoding on the bundled model: greedy exactness, acceptance, stop rules, statistics.

Each engine run is short (a few prompts, a dozen tokens); the plain greedy reference is computed
once per module and every speculative configuration must reproduce it token for token.
"""

from __future__ import annotations

import pytest

from pdserve.config import RuntimeConfig
from pdserve.decode.drafters import DraftModelDrafter, NgramDrafter
from pdserve.decode.speculative import FixedPolicy, SpeculativeStepper
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_model
from pdserve.sampling_params import SamplingParams

TEXTS = [
    # Repetitive: the answer copies the prompt, so NGRAM drafts get accepted.
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
    "Repeat: apple, banana, cherry,",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
    "Once upon a time",
]
K = 3
MAX_NEW = 1 + 3 * (K + 1)  # full-k steps only with a perfect drafter: the last step is capped at k


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, **kw})


def batch_params() -> list[SamplingParams]:
    # One row asks for logprobs, one carries a repetition penalty (the probs path of the verifier).
    return [params(), params(logprobs=True, top_logprobs_num=2), params(), params(repetition_penalty=1.3)]


def engine(loaded, make_stepper=None) -> Engine:
    cfg = RuntimeConfig(device="cpu", max_total_tokens=2048, attention_backend="torch", num_threads=1)
    return Engine(cfg, loaded, make_stepper)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def reference(bundled, prompts):
    return engine(bundled).generate(prompts, batch_params())


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, bundled, tiny_llama):
    """A 2-layer random Llama with the bundled model's vocabulary (so it can draft for it)."""
    folder = str(tmp_path_factory.mktemp("draft"))
    return load_model(
        tiny_llama(folder, vocab=bundled.spec.vocab_size, seed=0), dtype="float32", device="cpu"
    )


def check_same(outs, reference) -> None:
    for o, ref in zip(outs, reference):
        assert o.output_ids == ref.output_ids, o.room
        assert o.finish_reason == ref.finish_reason
        if ref.output_logprobs:
            assert len(o.output_logprobs) == len(ref.output_logprobs)
            assert max(abs(a - b) for a, b in zip(o.output_logprobs, ref.output_logprobs)) < 1e-3
            assert [[t for t, _ in top] for top in o.output_top_logprobs] == [
                [t for t, _ in top] for top in ref.output_top_logprobs
            ]


def check_stats(o, k: int) -> dict:
    s = o.stats
    hist = s["spec_correct_drafts_histogram"]
    assert len(hist) == k + 1
    assert sum(hist) == s["spec_verify_ct"]
    assert sum(i * n for i, n in enumerate(hist)) == s["spec_num_correct_drafts"]
    assert s["spec_num_correct_drafts"] <= s["spec_num_proposed_drafts"]
    # No stop token truncated a run here: every step emitted its accepted drafts plus the bonus.
    assert len(o.output_ids) == 1 + s["spec_verify_ct"] + s["spec_num_correct_drafts"]
    return s


def test_ngram_greedy_matches_plain_and_accepts(bundled, prompts, reference):
    offered: dict[str, int] = {}

    class CountingNgram(NgramDrafter):
        def propose(self, reqs, ks):
            drafts = super().propose(reqs, ks)
            for r, t in zip(reqs, drafts.tokens):
                offered[r.room] = offered.get(r.room, 0) + len(t)
            return drafts

    outs = engine(
        bundled, lambda runner: SpeculativeStepper(runner, CountingNgram(), FixedPolicy(), K)
    ).generate(prompts, batch_params())
    check_same(outs, reference)
    for o in outs:
        s = check_stats(o, K)
        assert s["spec_num_proposed_drafts"] == offered.get(o.room, 0)  # FixedPolicy keeps every offer
    assert outs[0].stats["spec_num_correct_drafts"] >= 4, outs[0].stats  # the list gets copied


def test_ngram_adaptive_greedy_matches_plain(bundled, prompts, reference):
    outs = engine(bundled, lambda runner: SpeculativeStepper(runner, NgramDrafter(), None, K)).generate(
        prompts, batch_params()
    )
    check_same(outs, reference)
    for o in outs:
        check_stats(o, K)
    # Speculation really ran (a policy that never drafts would match plain trivially): the
    # repetitive prompt's copied list gets drafts, and some are accepted.
    s = outs[0].stats
    assert s["spec_num_proposed_drafts"] > 0 and s["spec_num_correct_drafts"] > 0, s


def test_self_draft_accepts_everything_and_stops_inside_a_run(bundled, prompts, reference):
    stop_at = reference[0].output_ids[6]
    first = reference[0].output_ids.index(stop_at)
    plist = batch_params() + [params(stop_token_ids=[stop_at])]
    outs = engine(
        bundled,
        lambda runner: SpeculativeStepper(
            runner, DraftModelDrafter(runner, loaded=bundled), FixedPolicy(), K
        ),
    ).generate(prompts + [prompts[0]], plist)
    check_same(outs[:4], reference)
    for o in outs[:4]:
        s = check_stats(o, K)
        # Every step drafts K (the budget is a multiple of K + 1) and accepts all of them.
        assert s["spec_correct_drafts_histogram"] == [0] * K + [s["spec_verify_ct"]], s
        assert s["spec_num_correct_drafts"] == s["spec_num_proposed_drafts"]
    stopped = outs[4]
    assert stopped.output_ids == reference[0].output_ids[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_at}


def test_random_draft_model_greedy_matches_plain(bundled, prompts, reference, tiny_draft):
    outs = engine(
        bundled,
        lambda runner: SpeculativeStepper(
            runner, DraftModelDrafter(runner, loaded=tiny_draft), FixedPolicy(), K
        ),
    ).generate(prompts, batch_params())
    check_same(outs, reference)
    for o in outs:
        check_stats(o, K)
        assert o.stats["spec_num_proposed_drafts"] > 0


def test_draft_vocabulary_must_match(bundled, tiny_llama, tmp_path):
    folder = tiny_llama(str(tmp_path / "v16"), vocab=16, seed=1)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelDrafter(engine(bundled).runner, folder)
