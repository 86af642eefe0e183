"""Same-host KV hand-off through shared memory (kv_transfer/shm.py): exact bytes between two real
processes, bounds checks, the fall-back to the pair group, and the timeouts and aborts that fence."""

from __future__ import annotations

import os
import random
import stat
import time

import pytest
import torch
from kv_engines import FP
from kv_engines import random_pool as _pool
from kv_engines import wait_results as _wait

from pdserve.kv_transfer import KVReceiver, KVSender, TransferConfig, TransferState
from pdserve.kv_transfer.send_hooks import FaultySend, SendHooks
from pdserve.kv_transfer.shm import (
    HEADER_BYTES,
    SharedSegment,
    ShmError,
    copy_pages,
    remove_stale,
    shared_pool,
)
from pdserve.protocol.kv_trailer import FirstToken

PAGE = 16
GEOM = ["--layers", "2", "--heads", "2", "--head-dim", "8", "--page-size", str(PAGE)]
FAST = TransferConfig(
    bootstrap_timeout_s=5, waiting_timeout_s=2, transfer_timeout_s=5, chunk_bytes=1024, transport="auto"
)


@pytest.fixture
def nodes():
    """(sender, receiver, segment): the sender's pool in shared memory, as the prefill worker's."""
    made = []
    segments: list[str] = []

    def make(
        config: TransferConfig = FAST,
        sender_config: TransferConfig | None = None,
        hooks: SendHooks | None = None,
    ):
        segment, kv = shared_pool(_pool(32, 1))
        segments.append(segment.path)
        sender = KVSender(kv, FP, "127.0.0.1", 0, sender_config or config, segment=segment, hooks=hooks)
        sender.start()
        made.append(sender)
        receiver = KVReceiver(_pool(32, 2), FP, config)
        receiver.start()
        made.append(receiver)
        return sender, receiver, segment

    yield make
    for engine in made:
        engine.close()
    for path in segments:
        assert not os.path.exists(path)  # the sender removes its segment, offered or not


@pytest.mark.timeout(120)
def test_shm_transfers_are_byte_exact_between_processes_and_touch_only_destination_pages(spawn, tmp_path):
    shm = ["--transport", "auto"]
    prefill = spawn("prefill", "--seed", "1", "--pages", "150", *GEOM, *shm)
    decode = spawn("decode", "--seed", "2", "--pages", "120", *GEOM, *shm)
    prefill.call("dump", path=str(tmp_path / "src.pt"))
    decode.call("dump", path=str(tmp_path / "dst_before.pt"))
    assert decode.call("connect", addr=prefill.addr)["ok"]
    rng = random.Random(3)
    src_free, dst_free = list(range(150)), list(range(120))
    rooms = {"runs": (480, [*range(100, 120), *range(130, 140)], [*range(60, 75), *range(80, 95)])}
    for p in rooms["runs"][1]:
        src_free.remove(p)
    for p in rooms["runs"][2]:
        dst_free.remove(p)
    for name, tokens in [("r1", 1), ("r17", 17), ("r1000", 1000)]:
        n = -(-tokens // PAGE)
        src, dst = rng.sample(src_free, n), rng.sample(dst_free, n)
        src_free = [p for p in src_free if p not in src]
        dst_free = [p for p in dst_free if p not in dst]
        rooms[name] = (tokens, src, dst)
    # send() before the page list (runs, r1) and after it (r17, r1000).
    for name in ["runs", "r1"]:
        tokens, src, _ = rooms[name]
        prefill.call("send", room=name, pages=src, num_tokens=tokens, metadata={"first_token": tokens})
    for name, (tokens, _, dst) in rooms.items():
        decode.call("request", room=name, addr=prefill.addr, pages=dst, num_tokens=tokens)
    for name in ["r17", "r1000"]:
        tokens, src, _ = rooms[name]
        prefill.call("send", room=name, pages=src, num_tokens=tokens, metadata={"first_token": tokens})
    got = decode.call("wait", rooms=list(rooms), timeout=30)["results"]
    sent = prefill.call("wait", rooms=list(rooms), timeout=30)["results"]
    for name, (tokens, _, _) in rooms.items():
        assert got[name]["state"] == "SUCCESS" and got[name]["shm"], got[name]
        assert got[name]["metadata"] == {"first_token": tokens}
        assert sent[name]["state"] == "SUCCESS", sent[name]
        assert got[name]["num_bytes"] == sent[name]["num_bytes"] > 0

    decode.call("dump", path=str(tmp_path / "dst_after.pt"))
    src_kv = torch.load(tmp_path / "src.pt")
    expected = torch.load(tmp_path / "dst_before.pt")
    for _tokens, src, dst in rooms.values():
        expected[dst] = src_kv[src]
    assert torch.equal(torch.load(tmp_path / "dst_after.pt"), expected)


def test_copy_pages_refuses_page_ids_out_of_range():
    src, dst = _pool(8, 1), _pool(4, 2)
    before = dst.clone()
    for src_pages, dst_pages in [([8], [0]), ([-1], [0]), ([0], [4]), ([0, 1], [3, -2])]:
        with pytest.raises(ValueError, match="out of range"):
            copy_pages(src, src_pages, dst, dst_pages)
    assert torch.equal(dst, before)  # checked before anything is written
    assert copy_pages(src, [7, 2, 3], dst, [0, 2, 3]) == 3 * src[0].numel() * 4
    assert torch.equal(dst[[0, 2, 3]], src[[7, 2, 3]]) and torch.equal(dst[1], before[1])


@pytest.mark.timeout(60)
def test_out_of_range_pages_fail_the_room_on_both_sides(nodes):
    sender, receiver, _ = nodes()
    receiver.request("bad-src", sender.addr, [1, 2], 8)
    sender.send("bad-src", [3, 32], 8, FirstToken(first_token=1))  # the sender's pool has 32 pages
    receiver.request("bad-dst", sender.addr, [5, 99], 8)
    sender.send("bad-dst", [3, 4], 8, FirstToken(first_token=1))
    got = _wait(receiver, {"bad-src", "bad-dst"})
    sent = _wait(sender, {"bad-src", "bad-dst"})
    for name in ("bad-src", "bad-dst"):
        assert got[name].state == TransferState.FAILED and "out of range" in got[name].error, got[name]
        assert sent[name].state == TransferState.FAILED and "out of range" in sent[name].error, sent[name]
    # The pair still works.
    receiver.request("ok", sender.addr, [6, 7], 8)
    sender.send("ok", [8, 9], 8, FirstToken(first_token=2))
    assert _wait(receiver, {"ok"})["ok"].shm and _wait(sender, {"ok"})["ok"].state == TransferState.SUCCESS


@pytest.mark.timeout(60)
def test_a_token_that_does_not_read_back_falls_back_to_the_pair_group(nodes):
    sender, receiver, segment = nodes()
    with open(segment.path, "r+b") as f:  # another segment's bytes at this name: the token differs
        f.seek(8)
        f.write(bytes(32))
    receiver.request("r", sender.addr, [4, 5], 8)
    sender.send("r", [10, 11], 8, FirstToken(first_token=3))
    got = _wait(receiver, {"r"})["r"]
    assert got.state == TransferState.SUCCESS and not got.shm and got.metadata == FirstToken(first_token=3)
    assert _wait(sender, {"r"})["r"].state == TransferState.SUCCESS
    assert torch.equal(receiver._kv[[4, 5]], sender._kv[[10, 11]])


@pytest.mark.timeout(60)
def test_transport_dist_never_uses_shared_memory(nodes):
    dist = TransferConfig(bootstrap_timeout_s=5, waiting_timeout_s=2, transfer_timeout_s=5, transport="dist")
    sender, receiver, _ = nodes(FAST, dist)  # the sender does not offer its segment
    receiver.request("r", sender.addr, [1], 3)
    sender.send("r", [2], 3, FirstToken(first_token=0))
    assert not _wait(receiver, {"r"})["r"].shm
    sender2, receiver2, _ = nodes(dist, FAST)  # the receiver does not map the one offered
    receiver2.request("r", sender2.addr, [1], 3)
    sender2.send("r", [2], 3, FirstToken(first_token=0))
    got = _wait(receiver2, {"r"})["r"]
    assert got.state == TransferState.SUCCESS and not got.shm


@pytest.mark.timeout(60)
def test_sender_gives_up_on_a_copy_that_never_ends_and_the_late_copy_is_refused(nodes):
    """The prefill node announces late (test hook): by then it timed out and fenced its segment, so the
    decode must not commit what it would copy from pages the prefill node may have reused."""
    stalled = TransferConfig(
        bootstrap_timeout_s=5, waiting_timeout_s=5, transfer_timeout_s=0.5, transport="auto"
    )
    sender, receiver, segment = nodes(FAST, stalled, FaultySend(stall_data_s=1.5))
    fence = segment.fence
    receiver.request("slow", sender.addr, [1, 2], 8)
    sender.send("slow", [3, 4], 8, FirstToken(first_token=0))
    start = time.monotonic()
    sent = _wait(sender, {"slow"})["slow"]
    assert sent.state == TransferState.FAILED and "waiting for the decode to copy" in sent.error, sent
    assert 0.4 < time.monotonic() - start < 1.4
    assert segment.fence == fence + 1
    got = _wait(receiver, {"slow"})["slow"]
    assert got.state == TransferState.FAILED, got
    assert "gave up on the room" in got.error or "prefill aborted" in got.error, got.error


@pytest.mark.timeout(60)
def test_aborts_and_waiting_timeouts_behave_as_on_the_pair_group(nodes):
    sender, receiver, segment = nodes()
    # Decode aborts before any data: both sides fail, the prefill node's pages are free.
    receiver.request("gone", sender.addr, [1], 3)
    assert _wait_state(receiver, "gone", TransferState.WAITING_FOR_INPUT)
    receiver.abort("gone")
    assert _wait(receiver, {"gone"})["gone"].state == TransferState.FAILED
    time.sleep(0.1)
    sender.send("gone", [2], 3, FirstToken(first_token=0))
    assert _wait(sender, {"gone"})["gone"].state == TransferState.FAILED
    # No send() ever: the decode's wait times out (waiting_timeout_s = 2).
    receiver.request("late", sender.addr, [1], 3)
    got = _wait(receiver, {"late"}, timeout=10)["late"]
    assert got.state == TransferState.FAILED and "waiting for KV data" in got.error
    # Prefill aborts before the page list: the decode's room fails when its list arrives.
    sender.send("nope", [5], 3, FirstToken(first_token=0))
    sender.abort("nope")
    assert _wait(sender, {"nope"})["nope"].state == TransferState.FAILED
    receiver.request("nope", sender.addr, [1], 3)
    assert _wait(receiver, {"nope"})["nope"].state == TransferState.FAILED
    assert segment.fence == 0  # nothing was announced: nothing to fence


@pytest.mark.timeout(60)
def test_an_abort_after_the_announcement_waits_for_the_copy_and_never_fences(nodes):
    """A fence bump fails every copy running at that moment, so an abort of an announced room (a client
    gone right after its first token) must end the room on the decode's Copied, not by fencing."""
    stalled = TransferConfig(
        bootstrap_timeout_s=5, waiting_timeout_s=5, transfer_timeout_s=5, transport="auto"
    )
    sender, receiver, segment = nodes(FAST, stalled, FaultySend(stall_data_s=0.5))
    receiver.request("left", sender.addr, [1, 2], 8)
    sender.send("left", [3, 4], 8, FirstToken(first_token=0))
    assert _wait_state(sender, "left", TransferState.TRANSFERRING)  # Started: the announcement is under way
    sender.abort("left")
    time.sleep(0.2)
    assert sender.state("left") == TransferState.TRANSFERRING  # still waits for the decode's Copied
    sent = _wait(sender, {"left"})["left"]
    assert sent.state == TransferState.FAILED and sent.error == "aborted by prefill", sent
    assert _wait(receiver, {"left"})["left"].shm
    assert segment.fence == 0
    # The next room on the same pair copies as usual.
    receiver.request("next", sender.addr, [5], 3)
    sender.send("next", [6], 3, FirstToken(first_token=0))
    assert _wait(sender, {"next"})["next"].state == TransferState.SUCCESS
    assert torch.equal(receiver._kv[5], sender._kv[6])


def _wait_state(engine, room: str, state: TransferState, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while engine.state(room) != state and time.monotonic() < deadline:
        time.sleep(0.002)
    return engine.state(room) == state


def test_segment_is_private_sized_and_removed(tmp_path):
    seg = SharedSegment.create(4096, str(tmp_path))
    st = os.stat(seg.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == HEADER_BYTES + 4096
    seg.close()
    assert not os.path.exists(seg.path) and seg.fence == 1
    # A segment of a process that is gone is removed by the next one made in the directory.
    stale = tmp_path / "pdserve-kv-999999999-0123456789abcdef"
    stale.write_bytes(b"x")
    remove_stale(str(tmp_path))
    assert not stale.exists()
    # More than the filesystem holds: refused at creation (never a SIGBUS at the first write), no file left.
    with pytest.raises(ShmError, match="cannot size"):
        SharedSegment.create(1 << 50, str(tmp_path))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pdserve-kv-")]


def test_a_segment_takes_memory_only_for_pages_in_use(tmp_path):
    """The prefill's pool in shared memory stays sparse as its own pool is: only the pages written so
    far are copied and backed, and `commit` backs more before the allocator hands them out."""
    from pdserve.runtime.kv_pool import KVGeometry, KVPool

    pool = KVPool(KVGeometry(num_layers=8, kv_heads=4, head_dim=64, page_size=16, dtype=torch.float32), 64)
    page = pool.kv[0].nbytes  # 256 KiB
    pool.kv[:3] = torch.randn(pool.kv[:3].shape)
    segment, kv = shared_pool(pool.kv, str(tmp_path), used_pages=3)
    try:
        allocated = os.stat(segment.path).st_blocks * 512
        assert os.stat(segment.path).st_size == HEADER_BYTES + 64 * page
        assert 3 * page <= allocated <= 3 * page + HEADER_BYTES + 65536, allocated
        assert torch.equal(kv[:3], pool.kv[:3]) and not kv[3:].any()
        assert segment.commit(10 * page) and segment.committed == 10 * page
        assert os.stat(segment.path).st_blocks * 512 >= 10 * page
        assert segment.commit(4 * page)  # already backed
    finally:
        segment.close()
    assert not segment.commit(20 * page)  # closed: refused, never a write to an unbacked page
