"""Speculative decoding (NGRAM) on the decode node of a real cluster, and retraction under it.

One `pdserve up --speculative-algorithm NGRAM` cluster whose KV pools hold 384 tokens (24 pages):
the speculation test's batch fits without retraction; three long requests at once cannot.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_up
from reliability.calls import Outcome, metric, pool_sizes, stream, wait_pools

pytestmark = pytest.mark.timeout(600)

POOL_TOKENS = 384
NUM_DRAFTS = 4  # --speculative-num-draft-tokens (the default)
# Continuations that repeat what came before, so n-gram drafts get accepted.
REPEATING = ["a b c d e f g h a b c d e f g h a b c d", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]
COUNTING = [", ".join(str(i) for i in range(s, s + 10)) + "," for s in (1, 21, 41)]


@pytest.fixture(scope="module")
def spec_cluster(tmp_path_factory):
    c = start_up(
        tmp_path_factory.mktemp("spec"),
        extra=["--speculative-algorithm", "NGRAM", "--max-total-tokens", str(POOL_TOKENS)],
    )
    try:
        c.wait_healthy(workers=2)
        yield c
    finally:
        c.stop()


def _ids(texts: list[str]) -> list[list[int]]:
    from pdserve.gateway.text.tokenizer import Tokenizer

    tok = Tokenizer.load(None)
    return [tok.encode(t) for t in texts]


def _check_spec_counters(mi: dict) -> None:
    """SGLang's speculative fields of one request agree with each other and with its token count."""
    verify, proposed, correct = (
        mi["spec_verify_ct"],
        mi["spec_num_proposed_drafts"],
        mi["spec_num_correct_drafts"],
    )
    hist = mi["spec_correct_drafts_histogram"]
    ct = mi["completion_tokens"]
    assert len(hist) == NUM_DRAFTS + 1, mi
    assert sum(hist) == verify, mi  # every verify step accepted some k in 0..NUM_DRAFTS
    assert sum(k * n for k, n in enumerate(hist)) == correct, mi
    assert 0 <= correct <= proposed <= NUM_DRAFTS * verify, mi
    # The first token comes from the prefill node; each verify step adds its accepted drafts plus
    # one token, fewer only where the request finished inside the step.
    assert verify <= ct - 1 <= verify + correct, mi
    assert mi["spec_accept_rate"] == pytest.approx(correct / proposed if proposed else 0.0)
    assert mi["spec_accept_length"] == pytest.approx(ct / verify if verify else 0.0)


def test_ngram_speculation_equals_engine_and_transformers(spec_cluster, engine_reference):
    c = spec_cluster
    texts = [*REPEATING, "The capital of France is"]
    ids = _ids(texts)
    n = 40
    ours, hf = engine_reference(ids, n)
    proposed_before = metric(c.url, "pdserve_spec_proposed_drafts_total")
    # One batched request: the decode node verifies all three in the same forwards.
    req = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    r = httpx.post(c.url + "/generate", json=req, timeout=300)
    assert r.status_code == 200, r.text
    outs = r.json()
    for text, out, eng, ref in zip(texts, outs, ours, hf):
        assert out["output_ids"] == eng, text
        assert out["output_ids"] == ref[: len(out["output_ids"])], text
        mi = out["meta_info"]
        assert mi["num_retractions"] == 0, mi  # the batch fits: this is speculation alone
        _check_spec_counters(mi)
    # Drafts were proposed and accepted, so plain decoding cannot pass, and the repeating prompts
    # accept most of theirs.
    metas = [o["meta_info"] for o in outs]
    assert sum(m["spec_num_proposed_drafts"] for m in metas) > 0
    for m in metas[: len(REPEATING)]:
        assert m["spec_num_correct_drafts"] > 0, m
        assert m["spec_accept_length"] > 1.2, m
    assert metas[0]["spec_accept_rate"] > 0.5, metas[0]
    proposed = metric(c.url, "pdserve_spec_proposed_drafts_total") - proposed_before
    assert proposed == sum(m["spec_num_proposed_drafts"] for m in metas)
    # /get_server_info: each decode worker's average accept length (tokens per verify forward).
    states = httpx.get(c.url + "/get_server_info", timeout=30).json()["internal_states"]
    by_role = {s["role"]: s["avg_spec_accept_length"] for s in states}
    assert by_role["prefill"] is None and by_role["decode"] > 1.0, states


@pytest.mark.slow  # about a minute on two shared cores
def test_retraction_under_speculation_newest_first(spec_cluster, engine_reference):
    """Three long requests join the decode batch one after another; any two fit in the pool, three
    do not. The newest must be the one retracted (and resumed by recomputation): the two older never
    are. Every output still equals the offline engine's."""
    c = spec_cluster
    idle = pool_sizes(c.url)
    ids = _ids(COUNTING)
    n = 150
    ref, _ = engine_reference(ids, n)
    lifetimes = [len(p) + n for p in ids]
    pages = [-(-t // 16) for t in lifetimes]
    assert all(len(r) == n for r in ref)  # no early EOS: each request lives its whole budget
    assert pages[0] + pages[1] <= POOL_TOKENS // 16 < sum(pages), pages

    outs: list[Outcome | None] = [None] * len(ids)
    started = [threading.Event() for _ in ids]

    def one(i: int) -> None:
        req = {"input_ids": ids[i], "sampling_params": {"max_new_tokens": n, "temperature": 0}}
        outs[i] = stream(c.url, req, 300, first_chunk=started[i].set)

    with ThreadPoolExecutor(len(ids)) as pool:
        futures = []
        for i in range(len(ids)):
            futures.append(pool.submit(one, i))
            # The first chunk means the request runs on the decode node: the next one is newer.
            while not started[i].wait(0.2) and not futures[i].done():
                pass
        for f in futures:
            f.result()
    for i, o in enumerate(outs):
        assert o is not None and o.ok, (i, o)
        assert o.output_ids == ref[i], i
        _check_spec_counters(o.meta)
    retractions = [o.meta["num_retractions"] for o in outs]
    print("num_retractions (oldest first):", retractions)
    assert retractions[2] >= 1, retractions  # the pool ran short, and the newest gave way
    assert retractions[0] == retractions[1] == 0, retractions
    assert sum(o.meta["spec_num_correct_drafts"] for o in outs) > 0
    wait_pools(c.url, idle)
