"""The sampler takes any int and float a SamplingParams can hold without raising: top_k past the
vocabulary, seeds past int64 (`seed + j` for n > 1), token ids past the vocabulary or int64 in
stop_token_ids and logit_bias, tiny, NaN and infinite temperatures.

Values are set with `model_copy(update=...)`, which skips validation: a worker must survive what the
gateway's checks would refuse (a peer that validates less, a value derived after validation)."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sampling_batch import SEED_MODULUS, SamplingBatch
from pdserve.sampling_params import SamplingParams

VOCAB = 50
EOS = 7


def _params(**fields: object) -> SamplingParams:
    return SamplingParams().model_copy(update=fields)


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed))


def _sample(params: list[SamplingParams], vocab_size: int | None = VOCAB, produced: int = 0) -> list[int]:
    sb = SamplingBatch.build(params, eos_token_ids=[[EOS]] * len(params), vocab_size=vocab_size)
    n = len(params)
    out = Sampler()(_logits(n), sb, [[1, 2]] * n, [[3] * produced] * n, [produced] * n)
    ids = out.token_ids.tolist()
    assert all(0 <= t < VOCAB for t in ids), ids
    return ids


def test_top_k_past_int64_is_no_filter() -> None:
    logits = _logits(2)
    for top_k in (2**63, 2**64, VOCAB, VOCAB + 1):
        for vocab_size in (VOCAB, None):
            sb = SamplingBatch.build([_params(top_k=top_k, temperature=0.5)] * 2, vocab_size=vocab_size)
            probs = Sampler().probs(logits, sb, None, None)
            torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))
        _sample([_params(top_k=top_k, seed=1), _params(top_k=3)])
    assert not SamplingBatch.build([_params(top_k=2**63)], vocab_size=VOCAB).any_top_k


def test_seeds_past_int64_are_taken_modulo_2_63() -> None:
    # n = 2 with seed 2**63 - 1 gives its second sample seed 2**63 (gateway: seed + j).
    for seed in (2**63 - 1, 2**63, 2**64 + 5, 2**200, -1):
        sb = SamplingBatch.build([_params(seed=seed)])
        assert sb.seeds.tolist() == [seed % SEED_MODULUS]
    same = _sample([_params(seed=2**63 + 11)] * 3)
    assert same == _sample([_params(seed=11)] * 3)
    _sample([_params(seed=2**63 - 1), _params(seed=2**63), _params()])


def test_token_ids_outside_the_vocabulary_are_ignored() -> None:
    huge = [2**63, 2**64, VOCAB, -1, -(2**63) - 1]
    stop = _params(temperature=0, stop_token_ids=huge, min_new_tokens=1)
    bias = _params(temperature=0, logit_bias={t: 100.0 for t in huge})
    plain = _params(temperature=0)
    for vocab_size in (VOCAB, None):
        sb = SamplingBatch.build([stop, bias], eos_token_ids=[[EOS], [EOS]], vocab_size=vocab_size)
        # Only the real EOS is masked (without a vocabulary size: the ids within int64, left to
        # the sampler's own check against the logits' width).
        assert sb.min_new_ids.tolist() == ([EOS] if vocab_size else [EOS, VOCAB])
        assert sb.bias_ids.tolist() == ([] if vocab_size else [VOCAB])
        assert _sample([stop, bias, plain], vocab_size=vocab_size)[1:] == _logits(3).argmax(-1).tolist()[1:]
    # min_new_tokens past int64 still masks EOS, and does not overflow.
    sb = SamplingBatch.build([_params(min_new_tokens=2**70)], eos_token_ids=[[EOS]], vocab_size=VOCAB)
    assert sb.min_new_tokens.tolist() == [2**63 - 1]


def test_tiny_nan_and_negative_temperatures_are_greedy_and_huge_ones_finite() -> None:
    logits = _logits(1)
    for t in (1e-38, 5e-324, 1e-6, float("nan"), -1.0):
        sb = SamplingBatch.build([_params(temperature=t)], vocab_size=VOCAB)
        assert sb.all_greedy, t
        assert Sampler()(logits, sb, None, None, [0]).token_ids.tolist() == [int(logits.argmax())]
    for t in (1e300, float("inf")):
        probs = Sampler().probs(logits, SamplingBatch.build([_params(temperature=t)]), None, None)
        assert torch.isfinite(probs).all() and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-4)


_INTS = st.one_of(
    st.integers(-3, VOCAB + 3),
    st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**64), 2**100]),
)
_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-38, 1.0, 2.0]))


@st.composite
def _extreme_params(draw: st.DrawFn) -> SamplingParams:
    return _params(
        top_k=draw(_INTS),
        seed=draw(st.one_of(st.none(), _INTS)),
        temperature=draw(_FLOATS),
        top_p=draw(_FLOATS),
        min_p=draw(_FLOATS),
        repetition_penalty=draw(_FLOATS),
        frequency_penalty=draw(_FLOATS),
        presence_penalty=draw(_FLOATS),
        min_new_tokens=draw(_INTS),
        stop_token_ids=draw(st.lists(_INTS, max_size=4)),
        logit_bias=draw(st.dictionaries(_INTS, st.floats(-100, 100), max_size=4)),
        logprobs=draw(st.booleans()),
        top_logprobs_num=draw(st.integers(0, 20)),
    )


@given(params=st.lists(_extreme_params(), min_size=1, max_size=4), produced=st.integers(0, 3))
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_any_params_build_and_sample_without_raising(params: list[SamplingParams], produced: int) -> None:
    for vocab_size in (VOCAB, None):
        _sample(params, vocab_size=vocab_size, produced=produced)
