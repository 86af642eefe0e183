"""Sampler tests: each stage against a plain per-row reference written here."""

from __future__ import annotations

import torch

from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sampling_batch import SamplingBatch
from pdserve.sampling_params import SamplingParams

VOCAB = 64


def _logits(batch_size: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, vocab, generator=g) * 3.0  # [B, V]


def _ref_penalize(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    out = logits.clone()
    for tok in set(prompt) | set(output):
        v = out[tok].item()
        out[tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for tok in set(output):
        c = output.count(tok)
        out[tok] -= p.frequency_penalty * c + p.presence_penalty
    return out


def _ref_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, straightforward: softmax(l / T), then keep by rank / mass / ratio, renormalize."""
    if p.greedy:
        out = torch.zeros_like(logits)
        out[int(logits.argmax())] = 1.0
        return out
    probs = torch.softmax(logits / p.temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = torch.ones(len(probs), dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order):
        if p.top_k > 0 and rank >= p.top_k:
            keep[i] = False
        if p.top_p < 1.0 and mass > p.top_p:
            keep[i] = False
        mass += probs[i].item()
    keep &= probs >= probs.max() * p.min_p
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=3, min_p=0.3),
    SamplingParams(temperature=0.5, top_k=1),
]


def test_greedy_equals_argmax() -> None:
    logits = _logits(6)
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 6)
    out = Sampler()(logits, batch, None, None, [0] * 6)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_logprob_ids is None


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, [7, 3, 40]] = 5.0
    batch = SamplingBatch.build([SamplingParams(temperature=0.0), SamplingParams(top_k=1, logprobs=True)])
    assert Sampler()(logits, batch, None, None, [0, 0]).token_ids.tolist() == [3, 3]


def test_top_k_one_is_greedy_in_mixed_batch() -> None:
    logits = _logits(8, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5)] * 4
    batch = SamplingBatch.build(params)
    argmax = logits.argmax(dim=-1)
    for step in range(20):
        out = Sampler()(logits, batch, None, None, [step] * 8)
        assert torch.equal(out.token_ids[0::2], argmax[0::2])


def test_probs_match_per_row_reference_mixed_batch() -> None:
    logits = _logits(len(MIXED), seed=2)
    probs = Sampler().probs(logits, SamplingBatch.build(MIXED), None, None)
    for row, p in enumerate(MIXED):
        ref = _ref_probs(logits[row], p)
        assert torch.equal(probs[row] > 0, ref > 0), f"row {row} keeps a different set"
        torch.testing.assert_close(probs[row], ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(probs[row].sum(), torch.tensor(1.0))
    # The filters really did something: row 2 keeps exactly 5, row 6 at most 3.
    assert int((probs[2] > 0).sum()) == 5
    assert 1 <= int((probs[6] > 0).sum()) <= 3


def test_top_k_alone_and_min_p_alone_paths() -> None:
    # Batches without top-p take the partial top-k path; without top-k/top-p only the min-p mask.
    for params in (
        [SamplingParams(top_k=4), SamplingParams(), SamplingParams(top_k=9, temperature=0.5)],
        [SamplingParams(min_p=0.1), SamplingParams(min_p=0.5, temperature=3.0), SamplingParams()],
    ):
        logits = _logits(len(params), seed=3)
        probs = Sampler().probs(logits, SamplingBatch.build(params), None, None)
        for row, p in enumerate(params):
            ref = _ref_probs(logits[row], p)
            assert torch.equal(probs[row] > 0, ref > 0)
            torch.testing.assert_close(probs[row], ref, rtol=1e-5, atol=1e-7)


def test_temperature_scales_logits() -> None:
    logits = _logits(3, seed=4)
    temps = [0.25, 1.0, 4.0]
    probs = Sampler().probs(
        logits, SamplingBatch.build([SamplingParams(temperature=t) for t in temps]), None, None
    )
    for row, t in enumerate(temps):
        torch.testing.assert_close(probs[row], torch.softmax(logits[row] / t, dim=-1))
    # Low temperature sharpens, high temperature flattens.
    assert probs[0].max() > probs[1].max() > probs[2].max()


def test_penalties_match_per_row_reference() -> None:
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=1.0, frequency_penalty=0.7),
        SamplingParams(temperature=1.0, presence_penalty=1.5),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=0.4),
        SamplingParams(temperature=1.0),
    ]
    logits = _logits(len(params), seed=5)
    prompts = [[1, 2, 3], [4, 4, 5], [], [6, 7, 7, 8], [9]]
    outputs = [[3, 10, 10], [4, 11, 11, 11], [12, 12, 13], [7, 14, 14], [15, 15]]
    sampler = Sampler()
    batch = SamplingBatch.build(params)
    probs = sampler.probs(logits, batch, prompts, outputs)
    for row, p in enumerate(params):
        ref_logits = _ref_penalize(logits[row], p, prompts[row], outputs[row])
        torch.testing.assert_close(probs[row], _ref_probs(ref_logits, p), rtol=1e-5, atol=1e-7)
    # The greedy row picks the argmax of the penalized logits, as HF generate does.
    logits[0, 2] = 50.0  # a prompt token: penalized to 50 / 1.8 = 27.8, still the winner
    logits[0, 20] = 25.0
    tok = sampler(logits, batch, prompts, outputs, [0] * 5).token_ids[0]
    assert int(tok) == 2
    logits[0, 20] = 30.0  # now 30 > 27.8 although the raw argmax is still token 2
    ref0 = _ref_penalize(logits[0], params[0], prompts[0], outputs[0])
    tok = sampler(logits, batch, prompts, outputs, [0] * 5).token_ids[0]
    assert int(tok) == int(ref0.argmax()) == 20


def test_seeded_rows_independent_of_batch_mix_and_order() -> None:
    sampler = Sampler()
    vocab = 1000
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    logits_row = _logits(1, vocab, seed=6)[0]
    others = [SamplingParams(temperature=0.7, seed=99), SamplingParams(), SamplingParams(temperature=0.0)]

    def run(params: list[SamplingParams], row: int) -> list[int]:
        logits = _logits(len(params), vocab, seed=7)
        logits[row] = logits_row
        batch = SamplingBatch.build(params)
        return [int(sampler(logits, batch, None, None, [s] * len(params)).token_ids[row]) for s in range(30)]

    alone = run([target], 0)
    assert run([*others, target], 3) == alone
    assert run([others[1], target, others[0]], 1) == alone
    assert len(set(alone)) > 5  # really random across steps
    other_seed = run([target.model_copy(update={"seed": 1235})], 0)
    assert other_seed != alone


def test_salt_gives_independent_draws() -> None:
    sampler = Sampler()
    batch = SamplingBatch.build([SamplingParams(seed=5)])
    probs = torch.full((1, 1000), 1e-3)
    a = [int(sampler.draw(probs, batch, [s], salt=0)) for s in range(20)]
    b = [int(sampler.draw(probs, batch, [s], salt=1)) for s in range(20)]
    assert a == [int(sampler.draw(probs, batch, [s], salt=0)) for s in range(20)]
    assert a != b
    u = sampler.uniform(batch, [3], salt=7, n=4)
    assert u.shape == (1, 4) and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, sampler.uniform(batch, [3], salt=7, n=4))


def _empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_draw_matches_distribution_seeded_and_unseeded() -> None:
    target = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.07, 0.03])
    n = 20000
    sampler = Sampler()
    probs = target.expand(n, -1).contiguous()  # [n, 6]: one row per sample
    seeded = SamplingBatch.build([SamplingParams(seed=i) for i in range(n)])
    tokens = sampler.draw(probs, seeded, [0] * n)
    assert (_empirical(tokens, 6) - target).abs().max() < 0.02
    assert int((tokens == 2).sum()) == 0
    # Same seed over many steps: also the right distribution.
    one = SamplingBatch.build([SamplingParams(seed=42)] * n)
    tokens = sampler.draw(probs, one, list(range(n)))
    assert (_empirical(tokens, 6) - target).abs().max() < 0.02
    unseeded = SamplingBatch.build([SamplingParams()] * n)
    tokens = sampler.draw(probs, unseeded, [0] * n)
    assert (_empirical(tokens, 6) - target).abs().max() < 0.02


def test_logprobs_and_top_alternatives() -> None:
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=1.2, top_k=8, top_logprobs_num=5, seed=3),
        SamplingParams(temperature=0.9, top_logprobs_num=2),
    ]
    logits = _logits(3, seed=8)
    out = Sampler()(logits, SamplingBatch.build(params), None, None, [0, 0, 0])
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprob_ids is not None and out.top_logprob_vals is not None
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprob_ids.shape == (3, 5)
    for row in range(3):
        vals = out.top_logprob_vals[row]
        assert bool((vals[:-1] >= vals[1:]).all())
        torch.testing.assert_close(vals, ref[row, out.top_logprob_ids[row]])
        expected = sorted(range(VOCAB), key=lambda i: -ref[row, i].item())[:5]
        assert out.top_logprob_ids[row].tolist() == expected
