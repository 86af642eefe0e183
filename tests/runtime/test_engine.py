"""The runner's forward modes agree with each other, and the engine generates what transformers does."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner
from pdserve.sampling_params import SamplingParams

REL_TOL = 1e-4  # max |a - b| / max |b|, fp32
TIE_TOL = 1e-4  # a greedy divergence is excused only where transformers' top-2 logits are this close

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Hi",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three prime numbers:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Water boils at a temperature of",
    "In machine learning, overfitting happens when a model learns the training data so well that it",
]


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    rel = (a - b).abs().max().item() / b.abs().max().item()
    assert rel < REL_TOL, f"{what}: max|diff| / max|ref| = {rel:.2e}"


def new_request(runner: ModelRunner, room: str, prompt: list[int]) -> Request:
    req = Request(room, list(prompt), SamplingParams(max_new_tokens=8))
    assert runner.reserve(req, len(prompt))
    return req


def forward_all(runner: ModelRunner, mode: ForwardMode, reqs: list[Request], toks: list[list[int]]):
    """Like `ModelRunner.forward`, but logits at every new token, split per request."""
    batch = ForwardBatch.build(
        mode,
        toks,
        [r.num_computed for r in reqs],
        [r.pages for r in reqs],
        runner.page_size,
        all_logits=True,
    )
    logits = runner.model(batch, runner.pool, runner.backend)
    for r, t in zip(reqs, toks):
        r.num_computed += len(t)
    return list(logits.split([len(t) for t in toks]))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t).input_ids for t in TEXTS]


def test_extend_decode_and_verify_agree(bundled, make_engine, prompts):
    runner = make_engine(bundled, page_size=4).runner
    ps = [prompts[1], prompts[3], prompts[7]]  # 20+ tokens each, different lengths
    full = [new_request(runner, f"full{i}", p) for i, p in enumerate(ps)]
    ref = forward_all(runner, ForwardMode.EXTEND, full, ps)  # [len_i, V] each

    # Prefix, then decode the rest token by token (teacher forced), all requests in one batch.
    steps = 6
    cut = [len(p) - steps for p in ps]  # different prefix lengths, crossing page boundaries
    dec = [new_request(runner, f"dec{i}", p) for i, p in enumerate(ps)]
    last = runner.forward(ForwardMode.EXTEND, dec, [p[:c] for p, c in zip(ps, cut)])  # [3, V]
    for i, c in enumerate(cut):
        assert_close(last[i], ref[i][c - 1], f"prefix extend, request {i}")
    for s in range(steps):
        logits = runner.forward(ForwardMode.DECODE, dec, [[p[c + s]] for p, c in zip(ps, cut)])
        for i, c in enumerate(cut):
            assert_close(logits[i], ref[i][c + s], f"decode step {s}, request {i}")

    # Prefix, then one VERIFY forward of k+1 tokens per request: equal k+1 and mixed k+1.
    for ks in ([5, 5, 5], [2, 6, 4]):
        ver = [new_request(runner, f"ver{i}", p) for i, p in enumerate(ps)]
        cut = [len(p) - k for p, k in zip(ps, ks)]
        runner.forward(ForwardMode.EXTEND, ver, [p[:c] for p, c in zip(ps, cut)])
        logits = runner.forward(ForwardMode.VERIFY, ver, [p[c:] for p, c in zip(ps, cut)])
        rows = list(logits.split(ks))
        for i, c in enumerate(cut):
            assert_close(rows[i], ref[i][c:], f"verify k+1={ks[i]}, request {i}")
        for r in ver:
            runner.release(r)
    runner.allocator.check_invariants()


def test_extend_on_cached_prefix_pages_equals_full_extend(bundled, make_engine, tokenizer):
    runner = make_engine(bundled, page_size=4).runner
    shared = tokenizer("You are a helpful assistant. Answer briefly and precisely.").input_ids
    shared = shared[: len(shared) // 4 * 4]  # whole pages only can be shared
    assert len(shared) >= 8
    suffix_a = tokenizer(" What is two plus two?").input_ids
    suffix_b = tokenizer(" Name a color of the sky at noon.").input_ids
    other = tokenizer("Unrelated prompt in the same batch").input_ids

    owner = new_request(runner, "a", shared + suffix_a)
    runner.forward(ForwardMode.EXTEND, [owner], [owner.prompt_ids])

    # b reuses a's prefix pages (one more reference each) and extends only its suffix, batched
    # with a request that has no cached prefix at all.
    n_shared = len(shared) // runner.page_size
    b = Request("b", shared + suffix_b, SamplingParams())
    runner.allocator.incref(owner.pages[:n_shared])
    b.pages = list(owner.pages[:n_shared])
    b.num_computed = len(shared)
    assert runner.reserve(b, len(b.prompt_ids))
    fresh = new_request(runner, "other", other)
    got = forward_all(runner, ForwardMode.EXTEND, [b, fresh], [suffix_b, other])

    runner.release(owner)  # b still holds the shared pages
    runner.allocator.check_invariants()
    assert all(runner.allocator._refs[p] == 1 for p in b.pages)

    ref_b = new_request(runner, "ref-b", b.prompt_ids)
    ref_other = new_request(runner, "ref-other", other)
    want = forward_all(runner, ForwardMode.EXTEND, [ref_b, ref_other], [b.prompt_ids, other])
    assert_close(got[0], want[0][len(shared) :], "suffix on cached prefix pages")
    assert_close(got[1], want[1], "fresh request batched with a cached-prefix one")


def _check_against_hf(ours: list[int], hf_ids: list[int], hf_step_logits, what: str) -> bool:
    """True when identical; a divergence must sit on a near-tie of transformers' top-2 logits."""
    for i, (a, b) in enumerate(zip(ours, hf_ids)):
        if a != b:
            top2 = hf_step_logits[i][0].float().topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < TIE_TOL, f"{what}: token {i} is {a}, transformers {b} (top-2 gap {gap:.2e})"
            return False
    assert ours == hf_ids, f"{what}: lengths differ: {len(ours)} vs {len(hf_ids)}"
    return True


def test_greedy_generation_matches_transformers(bundled, hf_bundled, make_engine, prompts):
    engine = make_engine(bundled)
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    outs = engine.generate(prompts, params)
    identical = 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ids = torch.tensor([p])
        with torch.no_grad():
            hf = hf_bundled.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=bundled.spec.eos_token_ids[0],
            )
        hf_ids = hf.sequences[0, len(p) :].tolist()
        identical += _check_against_hf(out.output_ids, hf_ids, hf.logits, f"prompt {i}")
        reason = out.finish_reason["type"]
        assert reason == ("stop" if out.output_ids[-1] in bundled.spec.eos_token_ids else "length")
    assert identical >= len(prompts) - 2, "most prompts should match exactly, not only via near-ties"
    assert_all_pages_back(engine)


def assert_all_pages_back(engine) -> None:
    """Every page is free or cached, and emptying the cache frees all (no reference leaked)."""
    if engine.cache is not None:
        engine.cache.check_invariants()
        engine.cache.flush()
    assert engine.runner.allocator.num_free == engine.runner.allocator.num_pages
    engine.runner.allocator.check_invariants()


@pytest.fixture(scope="module")
def greedy_reference(bundled, prompts):
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine

    engine = Engine(RuntimeConfig(device="cpu", max_total_tokens=4096, disable_radix_cache=True), bundled)
    return [
        o.output_ids for o in engine.generate(prompts[:5], SamplingParams(max_new_tokens=12, temperature=0))
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(
            chunked_prefill_size=7
        ),  # every prompt but "Hi" is split; chunks of several requests share a forward
        dict(chunked_prefill_size=3, page_size=1),
        dict(max_running_requests=2),  # later requests wait, then join a running decode batch
        dict(max_total_tokens=96, page_size=8),  # the pool, not the request cap, limits admission
    ],
)
def test_scheduling_does_not_change_greedy_output(bundled, make_engine, prompts, greedy_reference, overrides):
    engine = make_engine(bundled, **overrides)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    outs = engine.generate(prompts[:5], params)
    assert [o.output_ids for o in outs] == greedy_reference
    # Again, one prompt at a time: each starts on its cached prefix, evicting others' when the pool is short.
    again = [engine.generate([p], params)[0] for p in prompts[:5]]
    assert [o.output_ids for o in again] == greedy_reference
    ps = engine.cfg.page_size
    assert [o.cached_tokens for o in again] == [(len(p) - 1) // ps * ps for p in prompts[:5]]
    assert_all_pages_back(engine)


def test_seeded_sampling_ignores_batch_company(bundled, make_engine, prompts):
    engine = make_engine(bundled)
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = engine.generate([prompts[0]], seeded)[0].output_ids
    company = [
        (prompts[3], SamplingParams(max_new_tokens=5, temperature=0)),
        (prompts[1], SamplingParams(max_new_tokens=20, temperature=0.7, seed=99)),
        (prompts[0], seeded),
        (prompts[6], SamplingParams(max_new_tokens=16, temperature=1.2, top_k=40)),
        (prompts[0], seeded),
    ]
    outs = engine.generate([p for p, _ in company], [sp for _, sp in company])
    assert outs[2].output_ids == alone
    assert outs[4].output_ids == alone
    other_seed = seeded.model_copy(update={"seed": 4321})
    assert engine.generate([prompts[0]], other_seed)[0].output_ids != alone


def test_finish_rules(bundled, make_engine, prompts):
    engine = make_engine(bundled)
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    base = engine.generate([prompts[4]], greedy)[0]
    assert len(base.output_ids) == 10 and base.finish_reason["type"] == "length"
    stop_tok = base.output_ids[3]
    first = base.output_ids.index(stop_tok)
    stopped = engine.generate([prompts[4]], greedy.model_copy(update={"stop_token_ids": [stop_tok]}))[0]
    assert stopped.output_ids == base.output_ids[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_tok}
    # max_new_tokens 0: the prompt runs, nothing is sampled (batched with requests that do sample).
    none = greedy.model_copy(update={"max_new_tokens": 0})
    outs = engine.generate([prompts[4], prompts[1], prompts[4]], [none, greedy, none])
    assert [o.output_ids for o in outs] == [[], outs[1].output_ids, []] and len(outs[1].output_ids) == 10
    assert outs[0].finish_reason == {"type": "length", "length": 0}
    assert_all_pages_back(engine)


def whole_pages_shared(a: list[int], b: list[int], page_size: int) -> int:
    """Tokens in the whole pages `a` starts with that `b` also starts with (the cache's independent oracle)."""
    n = 0
    while n + page_size <= min(len(a), len(b)) and a[n : n + page_size] == b[n : n + page_size]:
        n += page_size
    return n


def test_prefix_cache_hits_do_not_change_greedy_output(bundled, hf_bundled, make_engine, prompts, tokenizer):
    """Prompts that share no, some and all pages with a cached one generate what they generate with no
    cache (and what transformers does), and report the whole pages they were served as cached_tokens."""
    ps = 4
    cached = prompts[7]  # 20+ tokens
    suffix = tokenizer(" Something else entirely, said differently.").input_ids
    batch = [
        prompts[0],  # shares nothing
        cached[:9] + suffix,  # shares two whole pages
        cached + suffix,  # shares all the cached prompt's whole pages
        cached,  # the same prompt again: its last token is still computed
        cached[:12],  # three whole cached pages: the last one is computed again
    ]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    engine = make_engine(bundled, page_size=ps)
    first = engine.generate([cached], params)[0]
    assert first.cached_tokens == 0
    assert engine.cache is not None and engine.cache.num_pages == len(cached) // ps
    outs = engine.generate(batch, params)

    plain = make_engine(bundled, page_size=ps, disable_radix_cache=True)
    assert plain.cache is None
    want = plain.generate(batch, params)
    assert [o.output_ids for o in outs] == [w.output_ids for w in want]
    assert outs[3].output_ids == first.output_ids
    assert all(w.cached_tokens == 0 for w in want)

    expected = [min(whole_pages_shared(cached, p, ps), (len(p) - 1) // ps * ps) for p in batch]
    assert expected[0] == 0 and expected[1] == 8 and expected[2] == len(cached) // ps * ps
    assert expected[4] == 8
    assert [o.cached_tokens for o in outs] == expected

    for i, (p, out) in enumerate(zip(batch, outs)):
        ids = torch.tensor([p])
        with torch.no_grad():
            hf = hf_bundled.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=bundled.spec.eos_token_ids[0],
            )
        _check_against_hf(out.output_ids, hf.sequences[0, len(p) :].tolist(), hf.logits, f"prompt {i}")
    assert_all_pages_back(engine)
