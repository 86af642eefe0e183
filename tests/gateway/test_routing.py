"""Block hashes, the gateway's per-worker prefix index and the prefill routing policies, with no model
and no sockets: the registry fed the KVEvents a worker would send."""

from __future__ import annotations

import time

import pytest

from pdserve.gateway.cluster.prefix_index import PrefixIndex
from pdserve.gateway.cluster.workers import RoutingPolicy, WorkerInfo, WorkerRegistry
from pdserve.protocol.block_hash import ROOT_HASH, block_hash, block_hashes
from pdserve.protocol.gateway import KVEvents, Register

PAGE = 4


def test_block_hashes_chain_over_whole_pages():
    ids = list(range(10))
    hs = block_hashes(ids, PAGE)
    assert len(hs) == 2  # the partial third page has no hash
    assert hs[0] == block_hash(ROOT_HASH, ids[:4]) and hs[1] == block_hash(hs[0], ids[4:8])
    assert hs == block_hashes(ids[:8], PAGE)  # stable: the same prefix, the same names
    # The same page after another prefix is another block.
    other = block_hashes([9, 9, 9, 9] + ids[4:8], PAGE)
    assert other[1] != hs[1]
    assert all(0 <= h < 2**63 for h in hs + other)
    assert block_hashes(ids, 1) == block_hashes(ids, 1, ROOT_HASH) and len(block_hashes(ids, 1)) == 10
    with pytest.raises(ValueError, match="page_size"):
        block_hashes(ids, 0)


def test_index_counts_leading_cached_pages_and_leaves_the_last_token():
    ids = list(range(13))
    idx = PrefixIndex()
    assert idx.cached_tokens(ids, {}) == 0  # no events yet: nothing known
    idx.apply(KVEvents(worker_id="p0", page_size=PAGE, stored=block_hashes(ids, PAGE)))
    assert idx.cached_tokens(ids, {}) == 12
    assert idx.cached_tokens(ids[:12], {}) == 8  # the last token is always computed
    idx.apply(KVEvents(worker_id="p0", page_size=PAGE, removed=block_hashes(ids, PAGE)[1:2]))
    assert idx.cached_tokens(ids, {}) == 4  # a hole stops the prefix
    idx.apply(KVEvents(worker_id="p0", page_size=PAGE, snapshot=True, stored=block_hashes(ids, PAGE)[:1]))
    assert idx.blocks == set(block_hashes(ids, PAGE)[:1])
    idx.apply(KVEvents(worker_id="p0", page_size=2 * PAGE))  # another page size: old names mean nothing
    assert idx.blocks == set() and idx.cached_tokens(ids, {}) == 0


def _registry(
    policy: RoutingPolicy, tp_sizes: tuple[int, int] = (1, 1)
) -> tuple[WorkerRegistry, list[WorkerInfo]]:
    reg = WorkerRegistry(policy)
    ws = []
    for wid, tp in zip(("p0", "p1"), tp_sizes):
        r = Register(
            tp_size=tp,
            worker_id=wid,
            role="prefill",
            bootstrap_addr="127.0.0.1:1",
            fingerprint={},
            model_name="m",
            max_total_tokens=1024,
            max_running_requests=8,
            context_length=1024,
            vocab_size=100,
            t_send=time.time(),
        )
        ws.append(reg.add(r, wid.encode(), time.monotonic()))
    return reg, ws


def test_cache_aware_picks_the_worker_holding_the_prefix_unless_it_is_loaded():
    reg, (p0, p1) = _registry(RoutingPolicy("cache_aware", cache_weight=1.0, load_weight=1.0))
    prompt = list(range(40))
    p1.prefix.apply(KVEvents(worker_id="p1", page_size=PAGE, stored=block_hashes(prompt, PAGE)))
    assert [reg.pick("prefill", input_ids=prompt).worker_id for _ in range(4)] == ["p1"] * 4
    assert reg.pick("prefill", avoid={"p1"}, input_ids=prompt) is p0
    reg.acquire(p1, 30)  # 30 tokens queued on p1 cost less than 36 uncached on p0
    assert reg.pick("prefill", input_ids=prompt) is p1
    reg.acquire(p1, 20)  # 50 in flight: now p0 is cheaper
    assert reg.pick("prefill", input_ids=prompt) is p0
    # A prompt nobody holds: ties go round-robin, as before.
    assert {reg.pick("prefill", input_ids=[7] * 40).worker_id for _ in range(2)} == {"p0"}
    reg.release(p1, 30)
    reg.release(p1, 20)
    assert {reg.pick("prefill", input_ids=[7] * 40).worker_id for _ in range(2)} == {"p0", "p1"}


def test_round_robin_and_least_load_ignore_the_index():
    prompt = list(range(40))
    for name in ("round_robin", "least_load"):
        reg, (p0, p1) = _registry(RoutingPolicy(name))  # type: ignore[arg-type]
        p1.prefix.apply(KVEvents(worker_id="p1", page_size=PAGE, stored=block_hashes(prompt, PAGE)))
        picked = [reg.pick("prefill", input_ids=prompt).worker_id for _ in range(4)]
        assert sorted(picked) == ["p0", "p0", "p1", "p1"], name
    reg, (p0, p1) = _registry(RoutingPolicy("round_robin"))
    reg.acquire(p0, 100)
    assert {reg.pick("prefill").worker_id for _ in range(2)} == {"p0", "p1"}  # load ignored


def test_a_tensor_parallel_workers_load_counts_per_rank():
    """p1 is split over two ranks: it takes two requests for each one p0 takes."""
    for name in ("least_load", "cache_aware"):
        reg, (p0, p1) = _registry(RoutingPolicy(name), tp_sizes=(1, 2))  # type: ignore[arg-type]
        picked = []
        for _ in range(6):
            w = reg.pick("prefill", input_ids=[7] * 40)
            reg.acquire(w, 40)
            picked.append(w.worker_id)
        assert sorted(picked) == ["p0", "p0", "p1", "p1", "p1", "p1"], (name, picked)


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="not one of cache_aware, round_robin, least_load"):
        RoutingPolicy("random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        RoutingPolicy(cache_weight=-1)
