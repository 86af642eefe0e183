"""KV checksums (kv_transfer/checksum.py): a bit flipped after the prefill node hashed a page, on the
pair group or in the shared-memory segment, fails the room as corrupt on the decode node; with the
check off the same flip lands silently, which is what the check is for."""

from __future__ import annotations

import time

import pytest
import torch
from kv_engines import EnginePairs
from kv_engines import random_pool as _pool
from kv_engines import wait_results as _wait

from pdserve.kv_transfer import TransferConfig, TransferState
from pdserve.kv_transfer.checksum import KV_CORRUPT, SAMPLE_STRIDE, checked_indices, mismatch, page_hashes
from pdserve.kv_transfer.send_hooks import FaultySend, SendHooks
from pdserve.protocol.kv_trailer import FirstToken


def test_sample_hashes_the_first_the_last_and_every_stride_th_page():
    assert checked_indices(0, "all") == [] and checked_indices(5, "off") == []
    assert checked_indices(3, "all") == [0, 1, 2]
    assert checked_indices(1, "sample") == [0] and checked_indices(2, "sample") == [0, 1]
    n = 2 * SAMPLE_STRIDE + 5
    assert checked_indices(n, "sample") == [0, SAMPLE_STRIDE, 2 * SAMPLE_STRIDE, n - 1]


def test_a_flipped_bit_is_named_by_its_page_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kv = _pool(8, 0).to(dtype)
        pages = [6, 2, 5]
        want = page_hashes(kv, pages, [0, 1, 2])
        assert mismatch(kv, pages, want) is None
        kv[2].view(torch.uint8).view(-1)[37] ^= 4
        error = mismatch(kv, pages, want)
        assert error is not None and error.startswith(KV_CORRUPT) and "page 1 of 3" in error, error
        assert "outside" in (mismatch(kv, pages, [(3, 0)]) or "")  # an index past the room's pages


CASES = [pytest.param("dist", id="pair-group"), pytest.param("shm", id="shared-memory")]


def _config(transport: str, **kw) -> TransferConfig:
    return TransferConfig(
        bootstrap_timeout_s=5,
        waiting_timeout_s=5,
        transfer_timeout_s=5,
        chunk_bytes=1024,
        transport=transport,
        **kw,
    )


@pytest.fixture
def pair():
    """(sender, receiver) for a transport: a real pair group, and for "shm" the sender's pool in shared
    memory, which the receiver maps."""
    pairs = EnginePairs()

    def make(
        transport: str,
        sender_config: TransferConfig,
        receiver_config: TransferConfig | None = None,
        hooks: SendHooks | None = None,
    ):
        return pairs(
            sender_config, receiver_config or _config(transport), shm=transport == "shm", hooks=hooks
        )

    yield make
    pairs.close()


def _flip_during_stall(sender, room: str, page: int) -> None:
    """Once `room` started (hashed, data held back by the stall hook), flip a bit of `page`."""
    deadline = time.monotonic() + 5
    while sender.state(room) != TransferState.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.002)
    assert sender.state(room) == TransferState.TRANSFERRING
    sender._kv[page].view(torch.uint8).view(-1)[11] ^= 0x10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", CASES)
@pytest.mark.parametrize("mode", ["sample", "all", "off"])
def test_a_bit_flipped_after_the_hash_fails_the_room_as_corrupt(pair, transport, mode):
    # Both transports hash before Started; the stall then holds the data back long enough for the flip.
    sender, receiver = pair(
        transport, _config(transport, kv_checksum=mode), hooks=FaultySend(stall_data_s=1.5)
    )
    src, dst = [3, 4, 9], [7, 8, 20]
    receiver.request("r", sender.addr, dst, 10)
    sender.send("r", src, 10, FirstToken(first_token=1))
    _flip_during_stall(sender, "r", src[-1])
    got = _wait(receiver, {"r"})["r"]
    assert got.shm == (transport == "shm" and mode == "off")
    if mode == "off":  # nothing hashed: the flipped bit lands silently
        assert got.state == TransferState.SUCCESS and not got.corrupt, got
        assert not torch.equal(receiver._kv[dst[-1]], _pool(32, 1)[src[-1]])
        return
    assert got.state == TransferState.FAILED and got.corrupt, got
    assert got.error.startswith(KV_CORRUPT) and "first: page 2 of 3" in got.error, got.error
    # The next room on the same pair, untouched, lands intact.
    receiver.request("next", sender.addr, [1, 2], 8)
    sender.send("next", [5, 6], 8, FirstToken(first_token=2))
    ok = _wait(receiver, {"next"})["next"]
    assert ok.state == TransferState.SUCCESS and not ok.corrupt, ok
    assert torch.equal(receiver._kv[1:3], sender._kv[5:7])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", CASES)
def test_the_corruption_hook_fails_the_first_rooms_and_restores_the_prefill_pool(pair, transport):
    """--test-corrupt-kv: the hand-off is corrupt as the decode sees it, but the prefill node's own pages
    (its prefix cache) are flipped back once the transfer ended."""
    sender, receiver = pair(transport, _config(transport), hooks=FaultySend(corrupt_rooms=1))
    before = sender._kv.clone()
    receiver.request("bad", sender.addr, [1, 2], 8)
    sender.send("bad", [5, 6], 8, FirstToken(first_token=1))
    got = _wait(receiver, {"bad"})["bad"]
    assert got.state == TransferState.FAILED and got.corrupt and "page 1 of 2" in got.error, got
    _wait(sender, {"bad"})
    assert torch.equal(sender._kv, before)
    receiver.request("good", sender.addr, [3, 4], 8)
    sender.send("good", [5, 6], 8, FirstToken(first_token=1))
    ok = _wait(receiver, {"good"})["good"]
    assert ok.state == TransferState.SUCCESS and torch.equal(receiver._kv[3:5], before[5:7]), ok
