"""Sender and receiver state machines in one process (real zmq sockets and gloo pair groups, two threads
standing in for two nodes): timeouts, aborts, validation, pair eviction."""

from __future__ import annotations

import time

import pytest
import torch
from kv_engines import FP, EnginePairs
from kv_engines import random_pool as _pool
from kv_engines import wait_results as _wait

from pdserve.kv_transfer import KVReceiver, KVSender, TransferConfig, TransferState
from pdserve.protocol.kv_trailer import FirstToken

FAST = TransferConfig(bootstrap_timeout_s=5, waiting_timeout_s=0.5, transfer_timeout_s=5, chunk_bytes=1024)


@pytest.fixture
def nodes():
    pairs = EnginePairs()

    def make(config: TransferConfig = FAST, sender_config: TransferConfig | None = None):
        if sender_config is None:
            return pairs(config)
        return pairs(sender_config, config)

    yield make
    pairs.close()


@pytest.mark.timeout(60)
def test_sender_times_out_waiting_for_the_page_list(nodes):
    sender, _ = nodes()
    sender.send("lonely", [1, 2], 5, FirstToken(first_token=0))
    start = time.monotonic()
    result = _wait(sender, {"lonely"})["lonely"]
    assert result.state == TransferState.FAILED and "waiting for the decode's page list" in result.error
    assert 0.4 < time.monotonic() - start < 3


@pytest.mark.timeout(60)
def test_receiver_times_out_waiting_for_data_and_tells_the_sender(nodes):
    sender, receiver = nodes()
    receiver.request("slow-prefill", sender.addr, [3], 2)
    result = _wait(receiver, {"slow-prefill"})["slow-prefill"]
    assert result.state == TransferState.FAILED and "waiting for KV data" in result.error
    # The prefill node dropped the page list: a late send() waits, then fails, instead of transferring.
    sender.send("slow-prefill", [1], 2, FirstToken(first_token=0))
    late = _wait(sender, {"slow-prefill"})["slow-prefill"]
    assert late.state == TransferState.FAILED


@pytest.mark.timeout(60)
def test_decode_abort_fails_the_room_on_both_sides(nodes):
    sender, receiver = nodes(TransferConfig(waiting_timeout_s=30, chunk_bytes=1024))
    receiver.request("cancelled", sender.addr, [3, 4], 6)
    deadline = time.monotonic() + 10
    while receiver.state("cancelled") != TransferState.WAITING_FOR_INPUT and time.monotonic() < deadline:
        time.sleep(0.005)
    receiver.abort("cancelled")
    got = _wait(receiver, {"cancelled"})["cancelled"]
    assert got.state == TransferState.FAILED and got.error == "aborted by decode"
    sender.send("cancelled", [1, 2], 6, FirstToken(first_token=0))
    sent = _wait(sender, {"cancelled"})["cancelled"]
    assert sent.state == TransferState.FAILED and "aborted by decode" in sent.error, sent
    assert sent.seconds < 1  # refused at once, not after waiting for a page list that never comes


@pytest.mark.timeout(60)
def test_prefill_abort_fails_the_room_on_both_sides(nodes):
    sender, receiver = nodes(TransferConfig(waiting_timeout_s=30, chunk_bytes=1024))
    sender.send("dropped", [1, 2], 6, FirstToken(first_token=0))
    sender.abort("dropped")
    sent = _wait(sender, {"dropped"})["dropped"]
    assert sent.state == TransferState.FAILED and sent.error == "aborted by prefill"
    receiver.request("dropped", sender.addr, [3, 4], 6)
    got = _wait(receiver, {"dropped"}, timeout=5)["dropped"]
    assert got.state == TransferState.FAILED and "already finished on the prefill node" in got.error


@pytest.mark.timeout(60)
def test_token_count_mismatch_fails_both_sides_with_both_counts(nodes):
    sender, receiver = nodes(TransferConfig(waiting_timeout_s=30, chunk_bytes=1024))
    receiver.request("r", sender.addr, [3, 4], 6)
    sender.send("r", [1, 2, 5], 9, FirstToken(first_token=0))
    sent = _wait(sender, {"r"})["r"]
    got = _wait(receiver, {"r"})["r"]
    assert sent.state == got.state == TransferState.FAILED
    assert "prefill has 9, decode expects 6" in sent.error and "prefill has 9, decode expects 6" in got.error


@pytest.mark.timeout(60)
def test_unreachable_prefill_fails_at_bootstrap(nodes):
    _, receiver = nodes(TransferConfig(bootstrap_timeout_s=0.5, waiting_timeout_s=30))
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="no handshake reply"):
        receiver.connect("127.0.0.1:9")  # nothing listens on the discard port
    receiver.request("r", "127.0.0.1:9", [0], 1)
    assert "no handshake reply" in _wait(receiver, {"r"})["r"].error
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_pairs_beyond_max_pairs_evict_the_least_recently_used_idle_pair(nodes):
    config = TransferConfig(waiting_timeout_s=30, max_pairs=1, chunk_bytes=1024)
    sender, first = nodes(config)
    second = KVReceiver(_pool(8, 3), FP, config)
    second.start()
    try:
        first.connect(sender.addr)
        second.connect(sender.addr)  # evicts `first`, which is idle
        # `first` handshakes again on its next request (evicting `second`) and still transfers.
        first.request("r", sender.addr, [7], 3)
        sender.send("r", [2], 3, FirstToken(first_token=1))
        assert _wait(first, {"r"})["r"].state == TransferState.SUCCESS
        assert _wait(sender, {"r"})["r"].state == TransferState.SUCCESS
        # A busy pair is never evicted: with `first` waiting on a room, `second` is refused.
        first.request("busy", sender.addr, [8], 3)
        deadline = time.monotonic() + 10
        while first.state("busy") != TransferState.WAITING_FOR_INPUT and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.1)
        with pytest.raises(ConnectionError, match="limit of 1 pairs"):
            second.connect(sender.addr)
    finally:
        second.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_pools_over_gloo_are_staged_through_host_memory():
    config = TransferConfig(backend="gloo", waiting_timeout_s=30, chunk_bytes=4096)
    src = _pool(32, 1).cuda()
    dst = _pool(32, 2).cuda()
    expected = dst.clone()
    expected[[5, 0, 9]] = src[[1, 30, 7]]
    sender = KVSender(src, FP, "127.0.0.1", 0, config)
    receiver = KVReceiver(dst, FP, config)
    sender.start()
    receiver.start()
    try:
        receiver.request("gpu", sender.addr, [5, 0, 9], 10)
        sender.send("gpu", [1, 30, 7], 10, FirstToken(first_token=1))
        assert _wait(receiver, {"gpu"})["gpu"].state == TransferState.SUCCESS
        assert torch.equal(dst, expected)
    finally:
        sender.close()
        receiver.close()
