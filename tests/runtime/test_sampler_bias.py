"""logit_bias and min_new_tokens: the sampler's rows, the speculative path's probs, and greedy generation
equal to transformers' with the same bias (a logits processor) and `min_new_tokens`."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sampling_batch import SamplingBatch
from pdserve.sampling_params import SamplingParams

VOCAB = 50
EOS = 7


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=g)


def test_logit_bias_moves_only_its_row() -> None:
    logits = _logits(3)
    top = logits.argmax(dim=-1)
    target = int((top[1] + 1) % VOCAB)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={target: 100.0}),
        SamplingParams(temperature=0, logit_bias={int(top[2]): -100.0}),
    ]
    sb = SamplingBatch.build(params)
    out = Sampler()(logits, sb, [[1]] * 3, [[]] * 3, [0, 0, 0])
    assert out.token_ids[0] == top[0] and out.token_ids[1] == target
    assert out.token_ids[2] == logits[2].topk(2).indices[1]
    # probs (speculative verification) see the same bias.
    probs = Sampler().probs(logits, sb, [[1]] * 3, [[]] * 3)
    assert probs[1].argmax() == target and probs[2].argmax() == out.token_ids[2]


def test_logit_bias_on_sampled_rows_matches_the_biased_softmax() -> None:
    logits = _logits(1, seed=3)
    bias = {4: 2.0, 9: -1.5}
    sb = SamplingBatch.build([SamplingParams(temperature=0.7, logit_bias=bias)])
    probs = Sampler().probs(logits, sb, [[1]], [[]])
    ref = logits.clone()
    for t, b in bias.items():
        ref[0, t] += b
    torch.testing.assert_close(probs, torch.softmax(ref / 0.7, dim=-1))


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0  # EOS is the favourite
    logits[:, 3] = 9.0  # then a stop token id
    params = [
        SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[3]),
        SamplingParams(temperature=0),
    ]
    sb = SamplingBatch.build(params, eos_token_ids=[[EOS], [EOS]])
    for produced, want in ((0, 0), (1, 0), (2, EOS)):
        outs = [[5] * produced, [5] * produced]
        out = Sampler()(logits, sb, [[1]] * 2, outs, [produced] * 2)
        assert out.token_ids.tolist() == [want, EOS], produced
    # Logprobs stay those of the raw logits.
    sb = SamplingBatch.build(
        [SamplingParams(temperature=0, min_new_tokens=1, logprobs=True)], eos_token_ids=[[EOS]]
    )
    out = Sampler()(logits[:1], sb, [[1]], [[]], [0])
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits[:1], -1)[:, out.token_ids[0]])


class _Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


def _hf(hf_bundled, bundled, prompt: list[int], n: int, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    eos = list(bundled.spec.eos_token_ids)
    with torch.no_grad():
        out = hf_bundled.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_with_bias_and_min_new_tokens_matches_transformers(
    bundled, hf_bundled, make_engine, tokenizer
):
    engine = make_engine(bundled)
    msgs = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]
    prompt = list(
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    n = 24
    (plain,) = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=n))
    assert plain.output_ids[-1] in bundled.spec.eos_token_ids and len(plain.output_ids) < n - 6, (
        plain.output_ids
    )
    # min_new_tokens past the natural end: the EOS is masked until then, as transformers' min_new_tokens.
    k = len(plain.output_ids) + 4
    (longer,) = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=n, min_new_tokens=k))
    assert len(longer.output_ids) >= k
    assert longer.output_ids == _hf(hf_bundled, bundled, prompt, n, min_new_tokens=k)
    # A bias that takes over the first token, and one that forbids the greedy first token.
    first = plain.output_ids[0]
    for bias in ({tokenizer.encode("Maybe")[0]: 30.0}, {first: -100.0}):
        (ours,) = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12, logit_bias=bias))
        assert ours.output_ids != plain.output_ids[:12]
        assert ours.output_ids == _hf(
            hf_bundled, bundled, prompt, 12, logits_processor=LogitsProcessorList([_Bias(bias)])
        )


def test_speculative_verification_honours_bias_and_min_new_tokens(bundled, make_engine, tokenizer):
    """A self-draft proposes the unbiased greedy tokens (and the early EOS): verification must reject
    them where the bias or the mask changes the answer, and give the plain engine's output."""
    from pdserve.config import RuntimeConfig
    from pdserve.decode.drafters import DraftModelDrafter, NgramDrafter
    from pdserve.decode.speculative import FixedPolicy, SpeculativeStepper
    from pdserve.runtime.engine import Engine

    msgs = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]
    prompt = list(
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    (plain,) = make_engine(bundled).generate([prompt], SamplingParams(temperature=0, max_new_tokens=20))
    rows = [
        SamplingParams(temperature=0, max_new_tokens=20, min_new_tokens=len(plain.output_ids) + 3),
        SamplingParams(temperature=0, max_new_tokens=20, logit_bias={plain.output_ids[1]: -100.0}),
        SamplingParams(temperature=0, max_new_tokens=20),
    ]
    want = [o.output_ids for o in make_engine(bundled).generate([prompt] * 3, rows)]
    assert want[0] != plain.output_ids and want[1] != plain.output_ids and want[2] == plain.output_ids
    cfg = RuntimeConfig(device="cpu", max_total_tokens=4096, attention_backend="torch")
    for drafter in (lambda r: DraftModelDrafter(r, loaded=bundled), lambda r: NgramDrafter()):
        spec = Engine(cfg, bundled, lambda r, d=drafter: SpeculativeStepper(r, d(r), FixedPolicy(), 3))
        assert [o.output_ids for o in spec.generate([prompt] * 3, rows)] == want
