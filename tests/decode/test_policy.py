"""The NGRAM drafter's lookups and the adaptive policy's choices (plain Python, no model)."""

from __future__ import annotations

import pytest

from pdserve.decode.drafters import NgramDrafter
from pdserve.decode.speculative import AdaptivePolicy, CostModel
from pdserve.runtime.request import Request
from pdserve.sampling_params import SamplingParams


def req(room: str, prompt: list[int], output: list[int] = ()) -> Request:
    r = Request(room, list(prompt), SamplingParams(max_new_tokens=64))
    r.output_ids = list(output)
    return r


def test_ngram_copies_what_followed_the_latest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.lookup(req("a", [1, 2, 3, 4, 1, 2]), 4) == [3, 4, 1, 2]
    assert d.lookup(req("b", [1, 2, 9, 1, 2, 8, 1, 2]), 2) == [8, 1]  # most recent occurrence wins
    assert d.lookup(req("c", [1, 2, 3]), 3) == []  # nothing repeats
    assert d.lookup(req("d", [5, 9, 1, 2, 3, 4, 1]), 2) == [2, 3]  # falls back to a 1-gram
    assert NgramDrafter(min_n=2).lookup(req("e", [5, 9, 1, 2, 3, 4, 1]), 2) == []


def test_ngram_continues_a_periodic_pattern_past_the_end():
    d = NgramDrafter()
    assert d.lookup(req("a", [4, 7, 7, 7]), 5) == [7, 7, 7, 7, 7]
    assert d.lookup(req("b", [1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]


def test_ngram_index_follows_the_output_incrementally():
    d = NgramDrafter()
    r = req("a", [10, 11, 12], [13])
    assert d.lookup(r, 2) == []
    r.output_ids += [10, 11]  # "10 11" now repeats: 12 followed it
    assert d.lookup(r, 3) == [12, 13, 10]
    r.output_ids += [99]
    assert d.lookup(r, 3) == []
    d.forget(r)
    assert d.lookup(req("a", [1, 1, 1]), 1) == [1]  # a new request under the same id starts afresh


def test_cost_model_recovers_a_linear_cost():
    m = CostModel(prior_tokens=16.0)
    for t in [4, 8, 12, 16, 20, 4, 8, 12, 16, 20] * 5:
        m.observe(t, 0.010 + 0.002 * t)
    c0, c1 = m.coefficients()
    assert c0 == pytest.approx(0.010, rel=0.1)  # the ridge pulls slightly toward the prior
    assert c1 == pytest.approx(0.002, rel=0.1)  # the ridge pulls slightly toward the prior


def policy_with(c0: float, c1: float) -> AdaptivePolicy:
    p = AdaptivePolicy(prior_tokens=16.0)
    for t in [1, 5, 9, 17, 33] * 10:
        p.cost.observe(t, c0 + c1 * t)
    return p


def train(p: AdaptivePolicy, reqs: list[Request], k: int, accepted: int, steps: int = 20) -> None:
    c0, c1 = p.cost.coefficients()
    tokens = len(reqs) * (k + 1)
    for _ in range(steps):
        p.observe(tokens, c0 + c1 * tokens, [(r.room, k, accepted) for r in reqs])


def test_policy_speculates_on_small_batches_with_high_acceptance():
    p = policy_with(0.010, 0.0001)  # GPU-like: extra tokens nearly free
    reqs = [req(f"r{i}", [1]) for i in range(2)]
    train(p, reqs, 4, 4)
    assert p.choose(reqs, [4, 4], 0.0) == [4, 4]
    assert p.choose(reqs, [4, 1], 0.0) == [4, 1]  # never past the cap


def test_policy_turns_speculation_off_when_it_would_slow_down():
    p = policy_with(0.010, 0.0025)  # CPU-like: a token costs a quarter of the fixed cost
    reqs = [req(f"r{i}", [1]) for i in range(2)]
    train(p, reqs, 4, 0)
    assert p.choose(reqs, [4, 4], 0.0) == [0, 0]  # low acceptance
    big = [req(f"b{i}", [1]) for i in range(64)]
    train(p, big, 2, 1)  # acceptance ~0.5: worth it for one request, not for 64
    assert sum(p.choose(big, [4] * 64, 0.0)) == 0
    assert p.choose(big[:1], [4], 0.0)[0] > 0


def test_policy_prefers_the_requests_that_accept_and_probes_the_others():
    p = policy_with(0.010, 0.0010)
    good, bad = req("good", [1]), req("bad", [1])
    train(p, [good], 4, 4)
    train(p, [bad], 4, 0)
    ks = p.choose([good, bad], [4, 4], 0.0)
    assert ks[0] >= 3 and ks[1] == 0

    def idle_steps_until_probe() -> int:
        for n in range(1000):
            ks = p.choose([good, bad], [4, 4], 0.0)
            if ks[1]:
                return n
            p.observe(2 + ks[0], 0.012, [("good", ks[0], ks[0]), ("bad", 0, 0)])
        raise AssertionError("never probed")

    assert idle_steps_until_probe() == p.probe_every  # idle long enough: offered a probe
    p.observe(2 + 4, 0.012, [("good", 4, 4), ("bad", 1, 0)])  # the probe fails
    assert idle_steps_until_probe() == 2 * p.probe_every
    p.observe(2 + 4, 0.012, [("good", 4, 4), ("bad", 1, 0)])  # and fails again
    assert idle_steps_until_probe() == 4 * p.probe_every  # hopeless requests are probed ever more rarely


def test_policy_counts_draft_model_forwards():
    p = policy_with(0.010, 0.0001)
    reqs = [req("r", [1])]
    train(p, reqs, 4, 2)  # ~0.67 acceptance
    assert p.choose(reqs, [4], 0.0)[0] == 4
    assert p.choose(reqs, [4], 0.010)[0] == 0  # each draft forward as dear as a target forward
