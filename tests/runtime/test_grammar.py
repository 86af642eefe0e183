"""Structured output on the bundled model's tokenizer: masks, rollback (also under speculative
verification), the compile cache, invalid grammars, finish rules, and constrained generation with
the offline engine, plain and speculative."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdserve.config import RuntimeConfig
from pdserve.decode.drafters import Drafts
from pdserve.decode.speculative import FixedPolicy, SpeculativeStepper
from pdserve.runtime.engine import Engine
from pdserve.runtime.grammar import (
    DEAD_END,
    GrammarBackend,
    InvalidGrammar,
    apply_grammar_masks,
    fill_verify_masks,
)
from pdserve.runtime.request import Request
from pdserve.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
DOC = '{"name": "Ada", "age": 36, "pets": ["cat"]}'


@pytest.fixture(scope="module")
def backend(tokenizer, bundled) -> GrammarBackend:
    return GrammarBackend(tokenizer, bundled.spec.vocab_size, bundled.spec.eos_token_ids)


def allowed(matcher, vocab: int) -> set[int]:
    """The token ids matcher's mask allows next (unpacked from its int32 words)."""
    words = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_mask(words, 0)
    bits = (words[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def doc_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- masks, rollback -----------------------------------------------------------------------


def test_regex_mask_allows_exactly_the_continuations(backend, tokenizer, bundled):
    V, eos = bundled.spec.vocab_size, bundled.spec.eos_token_ids[0]
    m = backend.matcher("regex", "(yes|no)")
    first = allowed(m, V)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(s) or "no".startswith(s) for s in texts), texts
    assert eos not in first
    for t in doc_ids(tokenizer, "yes"):
        assert m.accept(t)
    assert allowed(m, V) == set(bundled.spec.eos_token_ids) and not m.is_terminated()
    assert not m.accept(doc_ids(tokenizer, "no")[0])  # refused: state unchanged
    assert m.accept(eos) and m.is_terminated()


def test_json_schema_mask_and_rollback(backend, tokenizer, bundled):
    V = bundled.spec.vocab_size
    m = backend.matcher("json_schema", json.dumps(SCHEMA))
    ids = doc_ids(tokenizer, DOC)
    masks = [allowed(m, V)]
    assert all(tokenizer.decode([t]).startswith("{") for t in masks[0])
    for t in ids:
        assert t in masks[-1]
        assert m.accept(t), tokenizer.decode([t])
        masks.append(allowed(m, V))
    assert masks[-1] == set(bundled.spec.eos_token_ids)  # the document is complete
    m.rollback(5)
    assert allowed(m, V) == masks[len(ids) - 5]
    for t in ids[-5:]:
        assert m.accept(t)
    assert allowed(m, V) == masks[-1]


def test_apply_masks_only_touches_constrained_rows(backend, bundled):
    V = bundled.spec.vocab_size
    m = backend.matcher("regex", "[0-9]{3}")
    logits = torch.randn(3, V)
    before = logits.clone()
    apply_grammar_masks(logits, [None, m, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    ok = allowed(m, V)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[list(ok)] = True
    assert torch.equal(logits[1][keep], before[1][keep])
    assert torch.isneginf(logits[1][~keep]).all()


def test_verify_masks_follow_drafts_and_roll_back(backend, tokenizer, bundled):
    """Row j is masked to the grammar after drafts[:j]; a refused draft stops the walk; the
    matcher ends where it started; the unconstrained request's rows are untouched."""
    V = bundled.spec.vocab_size
    m = backend.matcher("json_schema", json.dumps(SCHEMA))
    ids = doc_ids(tokenizer, DOC)
    bad = doc_ids(tokenizer, "Hello")[0]
    drafts = [[ids[0], ids[1], bad, ids[2]], [5, 6]]  # request 0: 5 rows, request 1: 3 rows
    logits = torch.zeros(8, V)
    start = allowed(m, V)
    fill_verify_masks(logits, [m, None], drafts)
    assert allowed(m, V) == start  # rolled back

    def allowed_row(r: int) -> set[int]:
        return set((~torch.isneginf(logits[r])).nonzero().flatten().tolist())

    ref = backend.matcher("json_schema", json.dumps(SCHEMA))
    assert allowed_row(0) == allowed(ref, V)
    ref.accept(ids[0])
    assert allowed_row(1) == allowed(ref, V)
    ref.accept(ids[1])
    assert allowed_row(2) == allowed(ref, V) and bad not in allowed_row(2)
    assert allowed_row(3) == set(range(V))  # after the refused draft: never used, left alone
    assert all(allowed_row(r) == set(range(V)) for r in (5, 6, 7))


# ---- cache, invalid grammars ---------------------------------------------------------------


def test_compile_cache_by_kind_and_text(tokenizer, bundled):
    b = GrammarBackend(tokenizer, bundled.spec.vocab_size, bundled.spec.eos_token_ids)
    text = json.dumps(SCHEMA)
    first = b.compile("json_schema", text)
    assert (b.stats.misses, b.stats.hits) == (1, 0) and b.stats.last_compile_seconds > 0
    assert b.compile("json_schema", text) is first
    assert (b.stats.misses, b.stats.hits) == (1, 1)
    b.compile("regex", text.replace("{", "").replace("}", "")[:10])
    assert b.stats.misses == 2
    for _ in range(2):  # a bad schema is compiled once, then refused from the cache
        with pytest.raises(InvalidGrammar):
            b.compile("json_schema", '{"type": "nonsense"}')
    assert (b.stats.misses, b.stats.hits) == (3, 2)


@pytest.mark.parametrize(
    "kind,text,needle",
    [
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1]", "must be an object"),
        ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
        ("regex", "(ab", "parenthesis is not closed"),
        ("ebnf", "root ::= missing", 'Rule "missing" is not defined'),
    ],
)
def test_invalid_grammar_names_the_problem(backend, kind, text, needle):
    with pytest.raises(InvalidGrammar) as e:
        backend.validate(kind, text)
    assert e.value.kind == kind
    assert str(e.value).startswith(f"invalid {kind}: ") and needle in str(e.value)
    assert not re.search(r"\.cc:\d+", str(e.value))  # no compiler log prefix


def test_sampling_params_take_at_most_one_constraint():
    assert SamplingParams(regex="a+").constraint == ("regex", "a+")
    assert SamplingParams().constraint is None
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a+", ebnf='root ::= "a"')


# ---- finish rules ----------------------------------------------------------------------------


def test_grammar_end_and_dead_end_finish_the_request(backend, tokenizer, bundled):
    eos = bundled.spec.eos_token_ids
    r = Request("a", [1], SamplingParams(ignore_eos=True), eos, grammar=backend.matcher("regex", "yes"))
    for t in doc_ids(tokenizer, "yes"):
        assert not r.append_token(t)
    assert r.append_token(eos[0])  # the grammar's end finishes it, even with ignore_eos
    assert r.finish_reason == {"type": "stop", "matched": eos[0]}

    r = Request("b", [1], SamplingParams(), eos, grammar=backend.matcher("regex", "yes"))
    assert r.append_token(doc_ids(tokenizer, "no")[0])  # a token the grammar refuses: dead end
    assert r.finish_reason is not None and r.finish_reason["type"] == DEAD_END


# ---- constrained generation (offline engine, bundled model) ------------------------------------


def engine(bundled, make_stepper=None) -> Engine:
    cfg = RuntimeConfig(device="cpu", max_total_tokens=4096, attention_backend="torch", num_threads=1)
    return Engine(cfg, bundled, make_stepper)


def chat(tokenizer, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [
        chat(tokenizer, "Describe a person with pets as JSON."),
        chat(tokenizer, "Give me a three digit number."),
        chat(tokenizer, "Name a planet."),
    ]


def batch_params(max_new: int = 48) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=max_new, temperature=0, json_schema=json.dumps(SCHEMA)),
        SamplingParams(max_new_tokens=max_new, temperature=0, regex="[1-9][0-9]{2}"),
        SamplingParams(max_new_tokens=12, temperature=0),  # unconstrained, in the same batch
    ]


@pytest.fixture(scope="module")
def constrained(bundled, prompts):
    return engine(bundled).generate(prompts, batch_params())


def test_engine_output_obeys_constraints(bundled, tokenizer, prompts, constrained):
    js, num, free = constrained
    assert js.finish_reason["type"] == "stop", js.finish_reason
    jsonschema.validate(json.loads(tokenizer.decode(js.output_ids, skip_special_tokens=True)), SCHEMA)
    assert re.fullmatch(r"[1-9][0-9]{2}", tokenizer.decode(num.output_ids, skip_special_tokens=True))
    # An unconstrained request's greedy tokens do not change next to constrained ones.
    alone = engine(bundled).generate([prompts[2]], SamplingParams(max_new_tokens=12, temperature=0))
    assert free.output_ids == alone[0].output_ids


class OracleDrafter:
    """Drafts the known constrained answer with one grammar-refused token at the end of every
    proposal, so that each verify step accepts drafts, rejects one by the mask and rolls back."""

    free = True

    def __init__(self, answers: dict[int, list[int]], bad: int):
        self.answers, self.bad = answers, bad
        self.proposed = 0

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            ans = self.answers.get(len(r.prompt_ids), [])
            d = ans[len(r.output_ids) : len(r.output_ids) + max(k - 1, 0)]
            out.append((d + [self.bad])[:k])
        self.proposed += sum(len(t) for t in out)
        return Drafts(out, [None] * len(reqs))

    def rollback(self, reqs):
        pass

    def forget(self, req):
        pass

    def draft_seconds(self, batch_size):
        return 0.0


def test_speculative_verification_keeps_grammar_and_greedy_output(bundled, tokenizer, prompts, constrained):
    answers = {len(p): o.output_ids for p, o in zip(prompts, constrained)}
    bad = doc_ids(tokenizer, "Hello")[0]  # refused by both grammars everywhere
    drafter = OracleDrafter(answers, bad)
    eng = engine(bundled, lambda runner: SpeculativeStepper(runner, drafter, FixedPolicy(), 4))
    outs = eng.generate(prompts, batch_params())
    for o, ref in zip(outs, constrained):
        assert o.output_ids == ref.output_ids
    js = outs[0].stats
    assert js["spec_num_correct_drafts"] > 0  # the oracle's drafts are taken ...
    assert js["spec_num_correct_drafts"] < js["spec_num_proposed_drafts"]  # ... the refused ones never


def test_sampled_speculative_output_obeys_schema(bundled, tokenizer, prompts):
    from pdserve.decode.drafters import NgramDrafter

    eng = engine(bundled, lambda runner: SpeculativeStepper(runner, NgramDrafter(min_n=1), FixedPolicy(), 3))
    sp = SamplingParams(max_new_tokens=64, temperature=0.9, seed=7, json_schema=json.dumps(SCHEMA))
    out = eng.generate([prompts[0]] * 2, [sp, sp.model_copy(update={"seed": 8})])
    for o in out:
        if o.finish_reason["type"] == "stop":
            jsonschema.validate(json.loads(tokenizer.decode(o.output_ids, skip_special_tokens=True)), SCHEMA)
        else:  # cut by max_new_tokens: still a prefix the grammar accepts
            assert o.finish_reason["type"] == "length"
        assert o.stats["spec_num_proposed_drafts"] > 0


class DeadEndMatcher:
    """A grammar with no way forward: its mask allows nothing, it accepts nothing."""

    def fill_mask(self, bitmask, row):
        bitmask[row].zero_()

    def accept(self, token):
        return False

    def rollback(self, n):
        pass

    def is_terminated(self):
        return False


def test_dead_end_ends_the_request_instead_of_hanging(bundled, prompts, monkeypatch):
    eng = engine(bundled)
    monkeypatch.setattr(eng.runner, "grammar_matcher", lambda params: DeadEndMatcher())
    out = eng.generate([prompts[0]], SamplingParams(max_new_tokens=32, temperature=0, regex="a"))[0]
    assert out.finish_reason["type"] == DEAD_END and len(out.output_ids) == 1


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_stay_finite_under_a_narrow_grammar(bundled, tokenizer, prompts, speculative):
    """Logprobs are the model's own (unmasked) ones: finite even where the grammar allows fewer tokens
    than top_logprobs_num, so they can cross the wire as JSON."""
    import math

    from pdserve.decode.drafters import NgramDrafter

    make = (
        (lambda runner: SpeculativeStepper(runner, NgramDrafter(min_n=1), FixedPolicy(), 3))
        if speculative
        else None
    )
    sp = SamplingParams(max_new_tokens=8, temperature=0, regex="(yes|no)", logprobs=True, top_logprobs_num=5)
    out = engine(bundled, make).generate([prompts[2]], sp)[0]
    assert tokenizer.decode(out.output_ids, skip_special_tokens=True) in ("yes", "no")
    assert len(out.output_logprobs) == len(out.output_ids)
    assert all(math.isfinite(lp) for lp in out.output_logprobs)
    assert all(len(top) == 5 and all(math.isfinite(v) for _, v in top) for top in out.output_top_logprobs)
