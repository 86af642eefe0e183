"""The KV hand-off between TP layouts through the real endpoints (pdserve/worker/kv_endpoints.py): on one
host each decode rank's pool takes its KV heads straight from the prefill rank that holds them (shared
memory); over the pair group every head goes through rank 0's full-head pool. Either way each decode
rank ends with exactly its slice of what the prefill ranks computed, byte for byte. A layout that cannot
map is refused at the handshake, naming both."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq
from kv_engines import FP, random_pool
from kv_engines import wait_results as _wait

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer import FingerprintMismatch, KVReceiver, KVSender, TransferConfig, TransferState
from pdserve.kv_transfer.layout import describe_split, kv_head_ranges, mapping_error
from pdserve.kv_transfer.shm import copy_heads
from pdserve.protocol import kv_control as kc
from pdserve.protocol.kv_trailer import FirstToken
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.engine import Engine
from pdserve.runtime.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.worker.kv_endpoints import receiver_for, sender_for

pytestmark = pytest.mark.timeout(600)

PROMPT = [5, 17, 99, 3, 42, 8] * 7
FAST = dict(bootstrap_timeout_s=10, waiting_timeout_s=10, transfer_timeout_s=20)


@pytest.fixture(scope="module")
def tp_nodes(tiny_folders):
    """For TP 1, 2 and 4 of the tiny 8-query / 2-KV-head model: (runner, sender, receiver over shared
    memory, receiver over the pair group only, the prompt's pages, free pages to receive into)."""
    nodes, made = {}, []
    for tp in (1, 2, 4):
        cfg = RuntimeConfig(
            model_path=tiny_folders["llama-untied"],
            device="cpu",
            dtype="float32",
            max_total_tokens=4096,
            tp_size=tp,
        )
        runner = Engine(cfg).runner
        req = Request("prompt", PROMPT, SamplingParams(max_new_tokens=1))
        sink = Request("sink", PROMPT, SamplingParams(max_new_tokens=1))
        assert runner.reserve(req, len(PROMPT)) and runner.reserve(sink, len(PROMPT))
        runner.forward(ForwardMode.EXTEND, [req], [PROMPT])
        sender = sender_for(runner, "127.0.0.1", 0, TransferConfig(transport="auto", **FAST))
        shm = receiver_for(runner, TransferConfig(transport="auto", **FAST))
        dist = receiver_for(runner, TransferConfig(transport="dist", **FAST))
        for e in (sender, shm, dist):
            e.start()
            made.append(e)
        nodes[tp] = (runner, sender, shm, dist, req.pages, sink.pages)
    yield nodes
    for e in made:
        e.close()
    for runner, *_ in nodes.values():
        runner.close()


def _rank_pools(runner) -> list[torch.Tensor]:
    return runner.rank_kv if runner.rank_kv is not None else [runner.pool.kv]


@pytest.mark.parametrize("transport", ["shm", "dist"])
@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 4), (4, 2), (4, 4)])
def test_each_decode_rank_ends_with_its_heads_of_the_prefill_ranks_kv(tp_nodes, p, d, transport) -> None:
    src, sender, *_, src_pages, _ = tp_nodes[p]
    dst, _, shm_receiver, dist_receiver, _, dst_pages = tp_nodes[d]
    receiver = shm_receiver if transport == "shm" else dist_receiver
    # What the prefill ranks hold, every head, and the TP-1 worker's own computation of it.
    every = [range(src.spec.num_kv_heads)]
    sent = torch.zeros_like(src.transfer_kv[: len(src_pages)])
    copy_heads(_rank_pools(src), src.head_split, src_pages, [sent], every, list(range(len(src_pages))))
    tp1 = tp_nodes[1][0]
    torch.testing.assert_close(sent, tp1.pool.kv[tp_nodes[1][4]], atol=1e-5, rtol=1e-5)
    for pool in _rank_pools(dst):
        pool[dst_pages] = 0
    room = f"{p}to{d}-{transport}"
    receiver.connect(sender.addr)
    receiver.request(room, sender.addr, dst_pages, len(PROMPT))
    sender.send(room, src_pages, len(PROMPT), FirstToken(first_token=7))
    got = _wait(receiver, {room}, timeout=60)[room]
    assert _wait(sender, {room}, timeout=60)[room].state == TransferState.SUCCESS
    assert got.state == TransferState.SUCCESS, got.error
    assert got.shm == (transport == "shm")
    if not got.shm:  # the decode worker's step: rank 0's full-head pool out to the ranks
        dst.after_receive(dst_pages)
    for pool, heads in zip(_rank_pools(dst), dst.head_split, strict=True):
        assert torch.equal(pool[dst_pages], sent[:, :, :, :, heads.start : heads.stop])


def test_every_tp_pair_of_a_model_maps_and_a_layout_that_does_not_split_is_named() -> None:
    assert kv_head_ranges(2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert kv_head_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert describe_split(4, 2) == "TP 2 (KV heads 0-1 | 2-3)"
    for p in (1, 2, 4, 8):
        for d in (1, 2, 4, 8):
            assert mapping_error(4, p, d) is None
    error = mapping_error(3, 1, 2)
    assert error == (
        "cannot map prefill layout TP 1 (KV heads 0-2) to decode layout "
        "TP 2 (TP 2 does not split 3 KV heads (neither divides the other))"
    )


def test_copy_heads_moves_each_head_from_the_first_rank_holding_it() -> None:
    full = random_pool(12, 1).repeat(1, 1, 1, 1, 2, 1)  # 4 KV heads
    src_pages, dst_pages = [3, 4, 5, 9], [0, 1, 7, 2]
    for p, d in [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 1)]:
        ph, dh = kv_head_ranges(4, p), kv_head_ranges(4, d)
        srcs = [full[:, :, :, :, h.start : h.stop].clone() for h in ph]
        dsts = [torch.zeros(8, *full.shape[1:4], len(h), full.shape[5]) for h in dh]
        copy_heads(srcs, ph, src_pages, dsts, dh, dst_pages)
        for pool, h in zip(dsts, dh):
            assert torch.equal(pool[dst_pages], full[src_pages][:, :, :, :, h.start : h.stop])
            untouched = [i for i in range(8) if i not in dst_pages]
            assert not pool[untouched].any()
    with pytest.raises(ValueError, match="out of range"):
        copy_heads([full], [range(4)], [12], [full.clone()], [range(4)], [0])


def test_a_layout_that_does_not_map_is_refused_at_the_handshake_naming_both(tmp_path) -> None:
    """A decode peer announcing TP 2 over the prefill's 3 KV heads: the prefill refuses the pair and
    says which two layouts do not map; a decode that gets such a HelloAck refuses it too."""
    kv = torch.zeros(8, 2, 2, 4, 3, 8)
    sender = KVSender(kv, FP, "127.0.0.1", 0, TransferConfig(transport="dist", **FAST))
    sender.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        receiver = KVReceiver(kv.clone(), FP, TransferConfig(transport="dist", **FAST))
        dealer.connect(f"tcp://{sender.addr}")
        hello = kc.Hello(receiver_id="peer", identity=receiver._identity, tp_size=2)
        dealer.send(kc.encode(hello))
        assert dealer.poll(10_000)
        ack = kc.decode(dealer.recv())
        assert isinstance(ack, kc.HelloAck) and not ack.ok and ack.mismatch
        assert "cannot map prefill layout TP 1 (KV heads 0-2) to decode layout TP 2" in ack.error
        assert "TP 2 does not split 3 KV heads" in ack.error
        assert any("cannot map prefill layout" in e for e in sender.handshake_errors())
        receiver.close()

        # The other way: a prefill that answers with a TP size the decode cannot map.
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        receiver = KVReceiver(kv.clone(), FP, TransferConfig(transport="dist", **FAST))
        receiver.start()
        outcome: list[BaseException | None] = []

        def connect() -> None:
            try:
                receiver.connect(f"127.0.0.1:{port}", timeout_s=10)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                outcome.append(e)

        thread = threading.Thread(target=connect)
        thread.start()
        identity, frame = router.recv_multipart()
        assert isinstance(kc.decode(frame), kc.Hello)
        router.send_multipart([identity, kc.encode(kc.HelloAck(ok=True, gen=0, tp_size=2))])
        thread.join(10)
        assert isinstance(outcome[0], FingerprintMismatch), outcome
        assert "cannot map prefill layout TP 2 (TP 2 does not split 3 KV heads" in str(outcome[0])
        assert "decode layout TP 1 (KV heads 0-2)" in str(outcome[0])
        receiver.close()
        router.close()
    finally:
        dealer.close()
        sender.close()
        ctx.term()
