"""The protocol package: every type round-trips, and every channel refuses a frame of another version
or a malformed body with a clear error, through the real receiving code (real zmq sockets), which
keeps serving afterwards."""

from __future__ import annotations

import asyncio
import threading
import time
import typing

import pytest
import torch
import zmq
from pydantic import BaseModel, TypeAdapter

from pdserve.gateway.cluster.control import ControlPlane
from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.kv_transfer import FingerprintMismatch, KVReceiver, KVSender, TransferConfig, TransferState
from pdserve.protocol import PROTOCOL_VERSION, MalformedFrame, ProtocolError, VersionMismatch
from pdserve.protocol import gateway as gw
from pdserve.protocol import kv_control as kc
from pdserve.protocol.kv_trailer import FirstToken, Trailer, decode_trailer, encode_trailer
from pdserve.protocol.records import DecodeEvents, PrefillEvents, RequestStats
from pdserve.protocol.vocabulary import AbortReason
from pdserve.sampling_params import SamplingParams
from pdserve.worker.link import RegistrationRefused, WorkerLink

pytestmark = pytest.mark.timeout(60)

FP = {"architecture": "TestLM", "page_size": 4, "weights_hash": "h"}
PREFILL_EVENTS = PrefillEvents(queue_entry=1.0, forward_entry=1.5, prefill_finished=2.0)
DECODE_EVENTS = DecodeEvents(decode_entry=1.2, kv_ready=2.1, finished=3.0)
STATS = RequestStats(
    cached_tokens=0,
    num_retractions=1,
    spec_verify_ct=3,
    spec_num_proposed_drafts=9,
    spec_num_correct_drafts=4,
    spec_correct_drafts_histogram=[1, 1, 1, 0],
)


def _register(worker_id: str = "d0", role: str = "decode") -> gw.Register:
    return gw.Register(
        worker_id=worker_id,
        role=role,
        bootstrap_addr="127.0.0.1:7000" if role == "prefill" else None,
        fingerprint=FP,
        model_name="m",
        max_total_tokens=4096,
        max_running_requests=8,
        context_length=2048,
        vocab_size=100,
        t_send=time.time(),
    )


GATEWAY_SAMPLES: list[BaseModel] = [
    _register("p0", "prefill"),
    gw.RegisterAck(accepted=False, reason="no"),
    gw.Ping(t0=1.0),
    gw.Pong(t0=1.0, t1=2.0, t2=3.0, queued=1, running=2, free_tokens=64, draining=True),
    gw.Deregister(worker_id="d0"),
    gw.GenerateRequest(
        room="r1",
        input_ids=[1, 2, 3],
        sampling=SamplingParams(
            max_new_tokens=4,
            temperature=0.0,
            stop=["x"],
            min_new_tokens=2,
            logit_bias={5: 1.5, 9: -100.0},
            no_stop_trim=True,
        ),
        prefill_worker="p0",
        prefill_bootstrap_addr="127.0.0.1:7000",
        decode_worker="d0",
        deadline_s=9.5,
    ),
    gw.AbortRequest(room="r1", reason=AbortReason.CANCELLED),
    gw.PrefillDone(room="r1", events=PREFILL_EVENTS, cached_tokens=2),
    gw.RequestFailed(room="r1", role="decode", code="oom", message="out of pages"),
    gw.TokenBatch(
        worker_id="d0",
        outputs=[
            gw.TokenOutput(
                room="r1",
                token_ids=[5, 6],
                logprobs=[-0.5, -0.25],
                top_logprobs=[[(5, -0.5), (7, -1.0)], [(6, -0.25)]],
                finished=True,
                finish_reason={"type": "length", "length": 2},
                events=DECODE_EVENTS,
                stats=STATS,
            )
        ],
    ),
    gw.KVEvents(worker_id="p0", page_size=4, snapshot=True, stored=[1, 2**63 - 1], removed=[7]),
    gw.FlushCache(flush_id="f1"),
    gw.FlushCacheDone(flush_id="f1", ok=False, message="p0 has 2 requests in flight"),
    gw.WeightsCommand(op_id="w1", op="prepare_disk", model_path="/models/step-20", weight_version="step-20"),
    gw.WeightsCommand(
        op_id="w2",
        op="init_group",
        group=gw.WeightsGroup(
            master_address="10.0.0.9", master_port=29600, rank=1, world_size=3, group_name="g", backend="gloo"
        ),
    ),
    gw.WeightsCommand(
        op_id="w3", op="prepare_distributed", names=["model.norm.weight"], dtypes=["float32"], shapes=[[576]]
    ),
    gw.WeightsReply(op_id="w1", ok=False, message="shape differs", seconds=0.5, weight_version="default"),
    gw.GenerateRequest(  # structured output: the constraint travels to both workers
        room="r2",
        input_ids=[1],
        sampling=SamplingParams(json_schema='{"type": "object"}'),
        prefill_worker="p0",
        prefill_bootstrap_addr="127.0.0.1:7000",
        decode_worker="d0",
    ),
    gw.SwitchRole(role="decode", epoch=2),
]

KV_SAMPLES: list[BaseModel] = [
    kc.Hello(receiver_id="abc", identity={**FP, "kv_transfer.backend": "gloo"}),
    kc.HelloAck(ok=True, gen=3),
    kc.HelloAck(ok=False, mismatch=True, error="page_size differs"),
    kc.HelloAck(
        ok=True, gen=0, shm=kc.ShmOffer(path="/dev/shm/pdserve-kv-1-00", token="ab" * 32, num_pages=64)
    ),
    kc.PageList(room="r1", pages=[4, 5, 9], num_tokens=40),
    kc.PageList(room="r2", pages=[9], num_tokens=40, skip_pages=2, prefix_hash=12345),
    kc.PrefixMismatch(room="r2", reason="other tokens"),
    kc.PageList(room="r3", pages=[1, 2], num_tokens=20, shm=True),
    kc.Announce(
        room="r3",
        seq=8,
        gen=-1,
        num_pages=2,
        chunk_pages=0,
        trailer_len=40,
        num_tokens=20,
        shm_pages=[7, 9],
        shm_fence=2,
        trailer="e30=",
    ),
    kc.Copied(room="r3", seq=8),
    kc.Announce(
        room="r1", seq=7, gen=3, num_pages=3, chunk_pages=2, runs=[2, 1], trailer_len=88, num_tokens=40
    ),
    kc.Build(gen=4),
    kc.PairDead(gen=3, reason="timed out"),
    kc.Abort(room="r1", reason="page list before a handshake", unknown_pair=True),
    kc.Bye(reason="shutting down"),
    kc.StoreSet(gen=3, key="pair/d0/3/0", value="AAEC"),
]


def _members(union) -> set[type]:
    return set(typing.get_args(typing.get_args(union)[0]))


def test_samples_cover_every_message_of_each_channel():
    assert {type(s) for s in GATEWAY_SAMPLES} == _members(gw.Message)
    assert {type(s) for s in KV_SAMPLES} == _members(kc.Message)


@pytest.mark.parametrize("msg", GATEWAY_SAMPLES, ids=lambda s: type(s).__name__)
def test_gateway_message_round_trip(msg):
    back = gw.decode(gw.encode(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", KV_SAMPLES, ids=lambda s: f"{type(s).__name__}")
def test_kv_control_message_round_trip(msg):
    back = kc.decode(kc.encode(msg))
    assert type(back) is type(msg) and back == msg


def test_trailer_and_first_token_round_trip():
    first = FirstToken(first_token=42, logprob=-0.5, top_logprobs=[(42, -0.5), (7, -2.0)], cached_tokens=3)
    hashes = [(0, 0), (3, (1 << 64) - 1)]
    t = decode_trailer(encode_trailer("r1", 40, first, hashes))
    assert (t.room, t.num_tokens, t.metadata, t.checksums) == ("r1", 40, first, hashes)
    assert Trailer.model_validate_json(t.model_dump_json()) == t
    with pytest.raises(ProtocolError, match="malformed KV trailer"):  # a checksum is 64 bits
        decode_trailer(
            encode_trailer("r1", 40, first, []).replace(b'"checksums":[]', b'"checksums":[[0,-1]]')
        )


@pytest.mark.parametrize(
    "record,value", [(PrefillEvents, PREFILL_EVENTS), (DecodeEvents, DECODE_EVENTS), (RequestStats, STATS)]
)
def test_records_round_trip_and_refuse_unknown_keys(record, value):
    adapter = TypeAdapter(record)
    assert adapter.validate_json(adapter.dump_json(value)) == value
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        adapter.validate_python({**value, "not_a_key": 1})


# ---- refusals at the codec -----------------------------------------------------------------------


def _with_version(frame: bytes, v: int) -> bytes:
    return frame.replace(b'{"v":%d,' % PROTOCOL_VERSION, b'{"v":%d,' % v, 1)


@pytest.mark.parametrize("codec,sample", [(gw, GATEWAY_SAMPLES[0]), (kc, KV_SAMPLES[0])])
def test_codec_refuses_another_version_and_malformed_bodies(codec, sample):
    with pytest.raises(
        VersionMismatch, match=f"version 99 refused: this node speaks {PROTOCOL_VERSION}"
    ) as e:
        codec.decode(_with_version(codec.encode(sample), 99))
    assert e.value.kind == sample.kind
    for bad in (
        b"",
        b"not json",
        b"[1, 2]",
        b'{"v": %d}' % PROTOCOL_VERSION,
        b'{"v": %d, "msg": {"kind": "martian"}}' % PROTOCOL_VERSION,
    ):
        with pytest.raises(MalformedFrame, match="malformed"):
            codec.decode(bad)
    wrong_field = codec.encode(sample).replace(b'"kind"', b'"unexpected":1,"kind"', 1)
    with pytest.raises(MalformedFrame, match="unexpected"):
        codec.decode(wrong_field)


def test_malformed_records_announce_and_trailer_are_refused():
    bad_events = gw.encode(GATEWAY_SAMPLES[7]).replace(b"queue_entry", b"queue_entri")
    with pytest.raises(MalformedFrame, match="queue_entri"):
        gw.decode(bad_events)
    announce = next(m for m in KV_SAMPLES if isinstance(m, kc.Announce) and m.runs)
    bad_runs = kc.encode(announce).replace(b"[2,1]", b"[2,2]")
    with pytest.raises(MalformedFrame, match="do not cover 3 pages"):
        kc.decode(bad_runs)
    skipping = next(m for m in KV_SAMPLES if isinstance(m, kc.PageList) and m.skip_pages)
    no_hash = kc.encode(skipping).replace(b'"prefix_hash":12345', b'"prefix_hash":null')
    with pytest.raises(MalformedFrame, match="must give the prefix hash"):
        kc.decode(no_hash)
    with pytest.raises(MalformedFrame, match="greater than or equal to 0"):
        kc.decode(kc.encode(skipping).replace(b'"skip_pages":2', b'"skip_pages":-1'))
    shm = next(m for m in KV_SAMPLES if isinstance(m, kc.Announce) and m.shm_pages)
    with pytest.raises(MalformedFrame, match="lists num_pages pages"):
        kc.decode(kc.encode(shm).replace(b"[7,9]", b"[7]"))
    with pytest.raises(ProtocolError, match="malformed KV trailer"):
        decode_trailer(b'{"room": "r1"}')
    with pytest.raises(ValueError):
        FirstToken.model_validate({"first_token": "many"})


def test_generate_request_legs_are_consistent():
    base = dict(room="r", input_ids=[1], prefill_bootstrap_addr="h:1", decode_worker="d0")
    gw.GenerateRequest(**base, sampling=SamplingParams(max_new_tokens=1), prefill_worker="p0")
    gw.GenerateRequest(
        **{**base, "decode_worker": ""}, sampling=SamplingParams(max_new_tokens=1), prefill_worker="p0"
    )
    gw.GenerateRequest(**{**base, "prefill_bootstrap_addr": ""}, sampling=SamplingParams(), prefill_worker="",
                       local_prefill=True)  # fmt: skip
    for bad in (
        dict(decode_worker="", sampling=SamplingParams(max_new_tokens=2), prefill_worker="p0"),
        dict(
            decode_worker="", sampling=SamplingParams(max_new_tokens=0), prefill_worker="", local_prefill=True
        ),
        dict(sampling=SamplingParams(), prefill_worker="p0", local_prefill=True),
        dict(sampling=SamplingParams(), prefill_worker=""),
        dict(sampling=SamplingParams(max_new_tokens=0), prefill_worker="p0"),  # 0 tokens with a decode leg
    ):
        with pytest.raises(ValueError):
            gw.GenerateRequest(**{**base, **bad})


def test_prefill_done_carries_one_first_token_or_none_when_it_finished():
    def done(first: gw.TokenOutput) -> gw.PrefillDone:
        return gw.PrefillDone(room="r1", events=PREFILL_EVENTS, first=first)

    assert done(gw.TokenOutput(room="r1", token_ids=[5])).first is not None
    ended = gw.TokenOutput(
        room="r1", token_ids=[], finished=True, finish_reason={"type": "length", "length": 0}
    )
    assert gw.decode(gw.encode(done(ended))) == done(ended)  # a prefill-only request
    for bad in (
        gw.TokenOutput(room="r1", token_ids=[5, 6]),
        gw.TokenOutput(room="r1", token_ids=[]),  # no token, yet not finished
        gw.TokenOutput(room="r2", token_ids=[5]),
    ):
        with pytest.raises(ValueError, match="first must be one token"):
            done(bad)


# ---- gateway <-> worker: the gateway's control plane --------------------------------------------


@pytest.fixture
def control_plane():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = GatewayConfig(
        control_host="127.0.0.1", control_port=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=5
    )
    cp = ControlPlane(cfg, WorkerRegistry(), GatewayMetrics())
    asyncio.run_coroutine_threadsafe(cp.start(), loop).result(5)
    try:
        yield cp
    finally:
        asyncio.run_coroutine_threadsafe(cp.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _dealer(ctx: zmq.Context, addr: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _recv(sock: zmq.Socket, codec, kind: type, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        msg = codec.decode(sock.recv_multipart()[-1])
        if isinstance(msg, kind):
            return msg
    raise TimeoutError(f"no {kind.__name__}")


def test_gateway_refuses_a_register_of_another_version_and_garbage_then_keeps_serving(control_plane):
    ctx = zmq.Context()
    sock = _dealer(ctx, f"tcp://127.0.0.1:{control_plane.bound_port}", b"d0")
    try:
        sock.send(_with_version(gw.encode(_register()), 97))
        ack = _recv(sock, gw, gw.RegisterAck)
        assert not ack.accepted and "register of protocol version 97 refused" in ack.reason
        assert control_plane.registry.get("d0") is None
        sock.send(b"\xff garbage")
        sock.send(gw.encode(_register()).replace(b'"vocab_size":100', b'"vocab_size":"many"'))
        sock.send(gw.encode(_register()))
        assert _recv(sock, gw, gw.RegisterAck).accepted
        assert control_plane.registry.get("d0") is not None
    finally:
        sock.close()
        ctx.term()


def test_gateway_applies_kv_events_and_drops_those_of_another_version_or_malformed(control_plane):
    ctx = zmq.Context()
    sock = _dealer(ctx, f"tcp://127.0.0.1:{control_plane.bound_port}", b"p0")
    try:
        sock.send(gw.encode(_register("p0", "prefill")))
        assert _recv(sock, gw, gw.RegisterAck).accepted
        old = gw.KVEvents(worker_id="p0", page_size=4, stored=[666])
        sock.send(_with_version(gw.encode(old), PROTOCOL_VERSION - 1))  # a release before KVEvents
        sock.send(
            gw.encode(gw.KVEvents(worker_id="p0", page_size=4, stored=[1])).replace(
                b'"page_size":4', b'"page_size":0'
            )
        )
        sock.send(gw.encode(gw.KVEvents(worker_id="p0", page_size=4, snapshot=True, stored=[1, 2, 3])))
        sock.send(gw.encode(gw.KVEvents(worker_id="p0", page_size=4, stored=[4], removed=[2])))
        index = control_plane.registry.get("p0").prefix
        deadline = time.monotonic() + 5
        while index.blocks != {1, 3, 4} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert index.blocks == {1, 3, 4} and index.page_size == 4
    finally:
        sock.close()
        ctx.term()


# ---- gateway <-> worker: the worker's link ---------------------------------------------------------


def _fake_gateway(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"127.0.0.1:{port}"


def test_worker_link_drops_bad_frames_and_keeps_answering_pings():
    ctx = zmq.Context()
    router, addr = _fake_gateway(ctx)
    link = WorkerLink(addr, _register, time.time)
    link.start()
    try:
        identity, frame = router.recv_multipart()
        assert isinstance(gw.decode(frame), gw.Register)
        router.send_multipart([identity, gw.encode(gw.RegisterAck(accepted=True))])
        link.wait_registered(5)
        router.send_multipart([identity, b"{not json"])
        router.send_multipart([identity, _with_version(gw.encode(gw.Ping(t0=1.0)), 99)])
        router.send_multipart([identity, b'{"v":%d,"msg":{"kind":"ping"}}' % PROTOCOL_VERSION])  # t0 missing
        router.send_multipart([identity, gw.encode(gw.Ping(t0=2.0))])
        pong = _recv(router, gw, gw.Pong)
        assert pong.t0 == 2.0  # only the good ping was answered
        assert link.inbox.empty()
    finally:
        link.close()
        router.close()
        ctx.term()


def test_worker_link_refuses_a_gateway_of_another_version():
    ctx = zmq.Context()
    router, addr = _fake_gateway(ctx)
    link = WorkerLink(addr, _register, time.time)
    link.start()
    try:
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, _with_version(gw.encode(gw.RegisterAck(accepted=True)), 99)])
        with pytest.raises(RegistrationRefused, match="version 99 refused"):
            link.wait_registered(5)
    finally:
        link.close()
        router.close()
        ctx.term()


# ---- prefill <-> decode: the KV sender's bootstrap server and the receiver ---------------------------

FAST = TransferConfig(bootstrap_timeout_s=5, waiting_timeout_s=10, transfer_timeout_s=5, chunk_bytes=1024)


def _pool(seed: int) -> torch.Tensor:
    return torch.randn(16, 2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(seed))  # [N,L,2,P,H,D]


def _result(engine, room: str, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in engine.poll():
            if r.room == room:
                return r
        time.sleep(0.01)
    raise TimeoutError(f"no result for {room}")


def _transfer(sender: KVSender, receiver: KVReceiver, room: str) -> None:
    """One real transfer: proves both ends still serve; the pages and the metadata arrive intact."""
    sender.send(room, [1, 2], 6, FirstToken(first_token=9))
    receiver.request(room, sender.addr, [3, 4], 6)
    got = _result(receiver, room)
    assert got.state == TransferState.SUCCESS and got.metadata == FirstToken(first_token=9), got
    assert _result(sender, room).state == TransferState.SUCCESS
    assert torch.equal(receiver._kv[[3, 4]], sender._kv[[1, 2]])


def test_bootstrap_server_refuses_a_hello_of_another_version_and_garbage_then_keeps_serving(sender, receiver):
    ctx = zmq.Context()
    sock = _dealer(ctx, f"tcp://{sender.addr}", b"stranger")
    try:
        sock.send(b"\x00\x01 garbage")
        sock.send(kc.encode(kc.PageList(room="x", pages=[1], num_tokens=1)).replace(b"[1]", b'"one"'))
        hello = kc.Hello(receiver_id="stranger", identity={})
        sock.send(_with_version(kc.encode(hello), 97))
        ack = _recv(sock, kc, kc.HelloAck)
        assert not ack.ok and ack.mismatch and "hello of protocol version 97 refused" in ack.error
        assert any("version 9" in e for e in sender.handshake_errors())
    finally:
        sock.close()
        ctx.term()
    _transfer(sender, receiver, "after-refusals")


def test_receiver_refuses_a_prefill_of_another_version_then_keeps_serving(sender, receiver):
    ctx = zmq.Context()
    router, addr = _fake_gateway(ctx)  # a ROUTER standing in for another release's bootstrap server
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            receiver.connect(addr, timeout_s=10)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=connect)
    thread.start()
    try:
        identity, frame = router.recv_multipart()
        assert isinstance(kc.decode(frame), kc.Hello)
        router.send_multipart([identity, b"garbage"])  # dropped: the handshake still waits
        time.sleep(0.2)
        assert not outcome
        router.send_multipart([identity, _with_version(kc.encode(kc.HelloAck(ok=True, gen=0)), 98)])
        thread.join(10)
        assert isinstance(outcome[0], FingerprintMismatch), outcome
        assert "hello_ack of protocol version 98 refused" in str(outcome[0])
    finally:
        thread.join(10)
        router.close()
        ctx.term()
    receiver.connect(sender.addr)
    _transfer(sender, receiver, "after-refusal")
