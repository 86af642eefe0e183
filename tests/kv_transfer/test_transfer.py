"""KV hand-off between two real processes over loopback gloo: exactness, handshake refusal, peer death."""

from __future__ import annotations

import random
import signal
import time

import pytest
import torch

from pdserve.kv_transfer.layout import direct_runs
from pdserve.protocol.block_hash import block_hashes

PAGE = 16
GEOM = ["--layers", "2", "--heads", "2", "--head-dim", "8", "--page-size", str(PAGE)]


def _pages(rng: random.Random, pool: list[int], num_tokens: int) -> list[int]:
    """Take ceil(num_tokens / PAGE) random page ids out of `pool` (no page used twice)."""
    n = -(-num_tokens // PAGE)
    picked = rng.sample(pool, n)
    for page in picked:
        pool.remove(page)
    return picked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transfers_are_byte_exact_and_touch_only_destination_pages(spawn, tmp_path, dtype):
    # Pages are 4 KiB here: runs of 2+ consecutive pages on both sides go pool to pool (no staging).
    direct = ["--direct-min-bytes", "8192"]
    prefill = spawn("prefill", "--seed", "1", "--pages", "150", "--dtype", dtype, *GEOM, *direct)
    decode = spawn("decode", "--seed", "2", "--pages", "120", "--dtype", dtype, *GEOM, *direct)
    prefill.call("dump", path=str(tmp_path / "src.pt"))
    decode.call("dump", path=str(tmp_path / "dst_before.pt"))
    assert decode.call("connect", addr=prefill.addr)["ok"]

    # r480 moves in three runs that are consecutive on both sides (pages 100-119 + 130-139 -> 60-74 +
    # 80-94): the direct path; the other rooms use random pages: staged chunks, on the same pair.
    run_src, run_dst = [*range(100, 120), *range(130, 140)], [*range(60, 75), *range(80, 95)]
    assert direct_runs(run_src, run_dst, 1000, 8192, 4096) == [15, 5, 10]
    src_free = [p for p in range(150) if p not in run_src]
    dst_free = [p for p in range(120) if p not in run_dst]
    rng = random.Random(7)
    rooms = {"r480": (480, run_src, run_dst)}
    for name, tokens in [("r1", 1), ("r17", 17), ("r1000", 1000), ("r33", 33)]:
        rooms[name] = (tokens, _pages(rng, src_free, tokens), _pages(rng, dst_free, tokens))
    assert direct_runs(rooms["r1000"][1], rooms["r1000"][2], 1000, 8192, 4096) is None
    # Both orders: send() before the decode's page list (r1, r33) and after it (r17); r1000 interleaved.
    for name in ["r480", "r1", "r33"]:
        tokens, src, _ = rooms[name]
        prefill.call(
            "send",
            room=name,
            pages=src,
            num_tokens=tokens,
            metadata={"first_token": tokens, "weight_version": name},
        )
    for name in ["r17", "r1000", "r1", "r33", "r480"]:
        tokens, _, dst = rooms[name]
        decode.call("request", room=name, addr=prefill.addr, pages=dst, num_tokens=tokens)
    for name in ["r1000", "r17"]:
        tokens, src, _ = rooms[name]
        prefill.call(
            "send",
            room=name,
            pages=src,
            num_tokens=tokens,
            metadata={"first_token": tokens, "weight_version": name},
        )

    got = decode.call("wait", rooms=list(rooms), timeout=60)["results"]
    sent = prefill.call("wait", rooms=list(rooms), timeout=30)["results"]
    for name, (tokens, _src, _dst) in rooms.items():
        assert got[name]["state"] == "SUCCESS", got[name]
        assert got[name]["metadata"] == {"first_token": tokens, "weight_version": name}
        assert sent[name]["state"] == "SUCCESS", sent[name]
        assert got[name]["num_bytes"] == sent[name]["num_bytes"] > 0
        assert got[name]["direct"] == (name == "r480"), (name, got[name])  # the path reported (traces)

    decode.call("dump", path=str(tmp_path / "dst_after.pt"))
    src_kv = torch.load(tmp_path / "src.pt")
    expected = torch.load(tmp_path / "dst_before.pt")  # [120, L, 2, P, H, D]
    for _tokens, src, dst in rooms.values():
        expected[dst] = src_kv[src]
    after = torch.load(tmp_path / "dst_after.pt")
    assert after.dtype == expected.dtype
    # Byte-exact at destination pages and untouched everywhere else.
    assert torch.equal(after.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.timeout(90)
def test_fingerprint_mismatch_is_refused_on_both_sides(spawn):
    prefill = spawn("prefill", "--page-size", "16")
    decode = spawn("decode", "--page-size", "32")
    reply = decode.call("connect", addr=prefill.addr)
    assert not reply["ok"] and reply["type"] == "FingerprintMismatch", reply
    assert "page_size: local=32 decode" not in reply["error"]
    assert "page_size: local=16 decode=32" in reply["error"], reply["error"]
    errors = prefill.call("errors")["errors"]
    assert len(errors) == 1 and "page_size: local=16 decode=32" in errors[0], errors

    # A request to the refusing node fails fast with the same reason instead of waiting for data.
    start = time.monotonic()
    decode.call("request", room="x", addr=prefill.addr, pages=[0], num_tokens=5)
    result = decode.call("wait", rooms=["x"], timeout=20)["results"]["x"]
    assert result["state"] == "FAILED" and "page_size" in result["error"], result
    assert time.monotonic() - start < 5


def _stall_transfer(prefill, decode, room: str, pages: int) -> None:
    """Freeze the decode process (SIGSTOP) with its page list sent, then start the transfer: the socket
    buffers fill up and the sender is stuck mid-send."""
    decode.call("request", room=room, addr=prefill.addr, pages=list(range(pages)), num_tokens=pages * PAGE)
    assert decode.call("wait_state", room=room, state="WAITING_FOR_INPUT", timeout=30)["ok"]
    time.sleep(0.2)  # let zmq's I/O thread flush the page list before the freeze
    decode.signal(signal.SIGSTOP)
    prefill.call(
        "send", room=room, pages=list(range(pages)), num_tokens=pages * PAGE, metadata={"first_token": 0}
    )
    assert prefill.call("wait_state", room=room, state="TRANSFERRING", timeout=30)["ok"]
    time.sleep(0.2)
    assert prefill.call("wait", rooms=[room], timeout=0)["results"] == {}  # still sending


BIG = ["--pages", "1200", "--page-size", str(PAGE), "--heads", "4", "--head-dim", "32", "--layers", "2"]
# 1200 pages x 32 KiB = 38 MiB: far more than the loopback socket buffers hold.


@pytest.mark.timeout(120)
def test_decode_killed_mid_transfer_fails_the_sender_then_a_new_pair_works(spawn):
    prefill = spawn("prefill", "--transfer-timeout", "4", *BIG)
    decode = spawn("decode", "--transfer-timeout", "4", *BIG)
    _stall_transfer(prefill, decode, "doomed", pages=1200)
    killed_at = time.monotonic()
    decode.kill()
    result = prefill.call("wait", rooms=["doomed"], timeout=30)["results"]["doomed"]
    assert result["state"] == "FAILED", result
    assert time.monotonic() - killed_at < 4 + 2  # within transfer_timeout (+ slack for a loaded machine)

    fresh = spawn("decode", "--seed", "5", *BIG)
    fresh.call("request", room="after", addr=prefill.addr, pages=[3, 4], num_tokens=20)
    prefill.call("send", room="after", pages=[10, 11], num_tokens=20, metadata={"first_token": 1})
    assert fresh.call("wait", rooms=["after"], timeout=30)["results"]["after"]["state"] == "SUCCESS"
    assert prefill.call("wait", rooms=["after"], timeout=30)["results"]["after"]["state"] == "SUCCESS"


@pytest.mark.timeout(120)
def test_prefill_killed_mid_transfer_fails_the_receiver_then_a_new_pair_works(spawn):
    prefill = spawn("prefill", "--transfer-timeout", "4", *BIG)
    decode = spawn("decode", "--transfer-timeout", "4", *BIG)
    _stall_transfer(prefill, decode, "doomed", pages=1200)
    prefill.kill()
    killed_at = time.monotonic()
    decode.signal(signal.SIGCONT)
    result = decode.call("wait", rooms=["doomed"], timeout=30)["results"]["doomed"]
    assert result["state"] == "FAILED", result
    assert time.monotonic() - killed_at < 4 + 2

    fresh = spawn("prefill", "--seed", "9", *BIG)
    decode.call("request", room="after", addr=fresh.addr, pages=[7], num_tokens=3)
    fresh.call("send", room="after", pages=[1], num_tokens=3, metadata={"first_token": 42})
    result = decode.call("wait", rooms=["after"], timeout=30)["results"]["after"]
    assert result["state"] == "SUCCESS" and result["metadata"] == {"first_token": 42}, result


@pytest.mark.timeout(120)
def test_timed_out_pair_is_rebuilt_under_a_new_generation(spawn):
    prefill = spawn("prefill", "--transfer-timeout", "2", *BIG)
    decode = spawn("decode", "--transfer-timeout", "2", *BIG)
    _stall_transfer(prefill, decode, "stalled", pages=1200)
    result = prefill.call("wait", rooms=["stalled"], timeout=30)["results"]["stalled"]
    assert result["state"] == "FAILED" and "timed out" in result["error"].lower(), result
    assert "gen 0" in result["error"], result
    decode.signal(signal.SIGCONT)
    result = decode.call("wait", rooms=["stalled"], timeout=30)["results"]["stalled"]
    assert result["state"] == "FAILED", result

    # Same two processes: the next transfer builds generation 1 and succeeds.
    decode.call("request", room="again", addr=prefill.addr, pages=[5, 6, 7], num_tokens=40)
    prefill.call("send", room="again", pages=[8, 9, 10], num_tokens=40, metadata={"first_token": 40})
    result = decode.call("wait", rooms=["again"], timeout=30)["results"]["again"]
    assert result["state"] == "SUCCESS" and result["metadata"] == {"first_token": 40}, result


@pytest.mark.timeout(120)
def test_incremental_transfer_moves_only_the_pages_after_an_agreed_prefix(spawn, tmp_path):
    """A decode node that holds a prompt's first pages lists only the rest; the prefill node checks the
    prefix hash, moves only those pages (bytes counted), and refuses a wrong hash, after which the same
    room is requested in full and succeeds."""
    prefill = spawn("prefill", "--seed", "1", "--pages", "40", *GEOM)
    decode = spawn("decode", "--seed", "2", "--pages", "40", *GEOM)
    prefill.call("dump", path=str(tmp_path / "src.pt"))
    decode.call("dump", path=str(tmp_path / "dst_before.pt"))
    assert decode.call("connect", addr=prefill.addr)["ok"]
    tokens = list(range(100, 100 + 5 * PAGE + 3))  # 5 whole pages and a partial one: 6 pages
    hashes = block_hashes(tokens, PAGE)
    src = list(range(0, 6))
    meta = {"first_token": 7}

    # Agreed prefix of 3 pages: 3 pages travel, into the 3 listed destination pages.
    prefill.call("send", room="inc", pages=src, num_tokens=len(tokens), metadata=meta, block_hashes=hashes)
    decode.call(
        "request",
        room="inc",
        addr=prefill.addr,
        pages=[30, 31, 32],
        num_tokens=len(tokens),
        skip_pages=3,
        prefix_hash=hashes[2],
    )
    got = decode.call("wait", rooms=["inc"], timeout=60)["results"]["inc"]
    assert got["state"] == "SUCCESS", got
    # A full transfer of one room (below) measures the bytes of 6 pages.
    prefill.call("send", room="full", pages=src, num_tokens=len(tokens), metadata=meta, block_hashes=hashes)
    decode.call("request", room="full", addr=prefill.addr, pages=list(range(10, 16)), num_tokens=len(tokens))
    full = decode.call("wait", rooms=["full"], timeout=60)["results"]["full"]
    assert full["state"] == "SUCCESS", full
    # Half the pages: half the page bytes (both also carry the same small trailer).
    assert got["num_bytes"] < full["num_bytes"] * 0.6, (got, full)

    # A wrong prefix hash: refused without failing the sender's room; the full page list then works.
    prefill.call("send", room="bad", pages=src, num_tokens=len(tokens), metadata=meta, block_hashes=hashes)
    decode.call(
        "request",
        room="bad",
        addr=prefill.addr,
        pages=[20, 21, 22],
        num_tokens=len(tokens),
        skip_pages=3,
        prefix_hash=hashes[2] ^ 1,
    )
    bad = decode.call("wait", rooms=["bad"], timeout=60)["results"]["bad"]
    assert bad["state"] == "FAILED" and bad["prefix_mismatch"], bad
    decode.call("request", room="bad", addr=prefill.addr, pages=list(range(20, 26)), num_tokens=len(tokens))
    again = decode.call("wait", rooms=["bad"], timeout=60)["results"]["bad"]
    assert again["state"] == "SUCCESS" and again["num_bytes"] == full["num_bytes"], again
    sent = prefill.call("wait", rooms=["inc", "full", "bad"], timeout=30)["results"]
    assert all(r["state"] == "SUCCESS" for r in sent.values()), sent

    decode.call("dump", path=str(tmp_path / "dst_after.pt"))
    src_kv = torch.load(tmp_path / "src.pt")
    expected = torch.load(tmp_path / "dst_before.pt")
    expected[[30, 31, 32]] = src_kv[[3, 4, 5]]  # only the pages after the skipped prefix
    expected[list(range(10, 16))] = src_kv[src]
    expected[list(range(20, 26))] = src_kv[src]
    after = torch.load(tmp_path / "dst_after.pt")
    assert torch.equal(after.view(torch.uint8), expected.view(torch.uint8))
