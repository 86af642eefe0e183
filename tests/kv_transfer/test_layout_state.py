"""Byte layout, state machine and handshake comparison (pure functions, no sockets)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.handshake import compare_identities, pair_identity
from pdserve.kv_transfer.layout import (
    MAX_CHUNKS,
    chunk_pages,
    chunk_ranges,
    chunk_view,
    direct_runs,
    gather_pages,
    geometry_of,
    pages_for,
    runs_fit,
    scatter_pages,
)
from pdserve.kv_transfer.state import TransferRoom as Room
from pdserve.kv_transfer.state import TransferState


def test_gather_chunks_then_scatter_reproduces_pages_exactly():
    torch.manual_seed(0)
    src = torch.randn(40, 3, 2, 4, 2, 5)  # [pages, L, 2, P, H, D]
    dst = torch.randn(30, 3, 2, 4, 2, 5)
    geometry = geometry_of(src)
    src_ids, dst_ids = [7, 3, 39, 0, 12], [29, 0, 4, 5, 11]
    per_chunk = chunk_pages(geometry, len(src_ids), chunk_bytes=2 * geometry.page_bytes)
    assert per_chunk == 2
    staging = torch.empty(per_chunk * geometry.page_bytes, dtype=torch.uint8)  # flat wire buffer
    expected = dst.clone()
    expected[dst_ids] = src[src_ids]
    for start, end in chunk_ranges(len(src_ids), per_chunk):
        view = chunk_view(staging, geometry, end - start)
        gather_pages(src, torch.tensor(src_ids[start:end]), view)
        assert view.data_ptr() == staging.data_ptr()  # gathered in place, no copy
        scatter_pages(
            dst, torch.tensor(dst_ids[start:end]), chunk_view(staging.clone(), geometry, end - start)
        )
    assert torch.equal(dst, expected)


def test_chunking_covers_every_page_once_and_caps_the_chunk_count():
    geometry = geometry_of(torch.empty(5000, 1, 2, 16, 1, 1))
    assert geometry.page_bytes == 2 * 16 * 4
    per_chunk = chunk_pages(geometry, 5000, chunk_bytes=1)  # tiny chunks requested
    ranges = chunk_ranges(5000, per_chunk)
    assert len(ranges) <= MAX_CHUNKS
    assert [p for s, e in ranges for p in range(s, e)] == list(range(5000))
    assert pages_for(1, 16) == 1 and pages_for(16, 16) == 1 and pages_for(17, 16) == 2


def test_geometry_rejects_non_pool_tensors():
    with pytest.raises(ValueError, match="KV pool must be"):
        geometry_of(torch.empty(2, 3, 4, 5, 6, 7))
    with pytest.raises(ValueError, match="contiguous"):
        geometry_of(torch.empty(4, 2, 2, 5, 6, 7).transpose(0, 1))


def test_state_machine_allows_only_forward_transitions():
    room = Room.enter("r", TransferState.BOOTSTRAPPING, timeout_s=10, started=0.0)
    assert room.deadline is not None
    room.transition(TransferState.WAITING_FOR_INPUT, timeout_s=None)
    assert room.deadline is None and not room.expired(1e18)
    room.transition(TransferState.TRANSFERRING)
    with pytest.raises(RuntimeError, match="illegal transfer transition TRANSFERRING -> WAITING_FOR_INPUT"):
        room.transition(TransferState.WAITING_FOR_INPUT)
    room.transition(TransferState.SUCCESS)
    assert room.terminal
    with pytest.raises(RuntimeError, match="illegal"):
        room.transition(TransferState.FAILED)
    expiring = Room.enter("e", TransferState.WAITING_FOR_INPUT, timeout_s=0.0, started=0.0)
    assert expiring.expired(expiring.deadline)


def test_identity_comparison_names_every_differing_field_with_both_values():
    kv16 = geometry_of(torch.empty(8, 2, 2, 16, 2, 4))
    kv32 = geometry_of(torch.empty(8, 2, 2, 32, 2, 4))
    fp = {"architecture": "A", "page_size": 16, "weights_hash": "h1"}
    mine = pair_identity(fp, kv16, "gloo")
    assert compare_identities(mine, pair_identity(fp, kv16, "gloo"), "decode") is None
    theirs = pair_identity({**fp, "page_size": 32, "weights_hash": "h2"}, kv32, "gloo")
    error = compare_identities(mine, theirs, "decode")
    assert "page_size: local=16 decode=32" in error
    assert "weights_hash: local='h1' decode='h2'" in error
    assert "kv_transfer.page_shape: local='2x2x16x2x4' decode='2x2x32x2x4'" in error
    assert "architecture" not in error
    missing = compare_identities(mine, {k: v for k, v in mine.items() if k != "weights_hash"}, "decode")
    assert "weights_hash: local='h1' decode='<missing>'" in missing


def test_direct_runs_split_where_either_side_breaks_and_refuse_fragmented_lists():
    src, dst = [4, 5, 6, 7, 20, 21], [10, 11, 30, 31, 32, 33]
    assert direct_runs(src, dst, max_pages=8, min_bytes=1, page_bytes=1) == [2, 2, 2]
    assert direct_runs(list(range(10)), list(range(5, 15)), 4, 1, 1) == [4, 4, 2]  # capped pieces
    # Average run below min_bytes: staged chunks instead (None).
    assert direct_runs(src, dst, max_pages=8, min_bytes=3, page_bytes=1) is None
    assert direct_runs([3, 1, 2], [0, 1, 2], 8, 1, 1) == [1, 2]
    assert direct_runs([], [], 8, 1, 1) is None
    # The receiver's own check of announced runs against its page list.
    assert runs_fit(dst, [2, 2, 2]) and runs_fit(dst, [1, 1, 4])
    assert not runs_fit(dst, [3, 3]) and not runs_fit([5, 4], [2])
