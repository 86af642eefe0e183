"""KV page gather/scatter and the new-token KV store against torch indexing."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_copy import (
    gather_kv_pages,
    gather_kv_pages_ref,
    scatter_kv_pages,
    scatter_kv_pages_ref,
    store_kv,
    store_kv_ref,
)

F32, BF16 = torch.float32, torch.bfloat16


def _pool(layers, pages, page, heads, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, pages, page, heads, dim), generator=g).to(dtype).to(device)


# (layers, pool pages, page_size, heads, head_dim, dtype, index dtype, page ids)
PAGE_CASES = [
    (2, 9, 16, 2, 64, F32, torch.int32, [7, 2, 8]),
    (1, 5, 1, 3, 32, BF16, torch.int64, [4]),
    (3, 6, 64, 1, 64, BF16, torch.int32, [0, 5, 3, 1]),
    (2, 4, 16, 2, 64, F32, torch.int64, []),
]


@pytest.mark.parametrize("layers,pages,page,heads,dim,dtype,idx,ids", PAGE_CASES)
def test_gather_matches_indexing(device, layers, pages, page, heads, dim, dtype, idx, ids):
    kv = _pool(layers, pages, page, heads, dim, dtype, device)
    page_ids = torch.tensor(ids, dtype=idx, device=device)
    out = torch.full((layers, 2, len(ids), page, heads, dim), float("nan"), dtype=dtype, device=device)
    gather_kv_pages(kv, page_ids, out=out)
    torch.testing.assert_close(out, gather_kv_pages_ref(kv, page_ids), atol=0, rtol=0)
    # allocating variant returns the same
    torch.testing.assert_close(gather_kv_pages(kv, page_ids), out, atol=0, rtol=0)


@pytest.mark.parametrize("layers,pages,page,heads,dim,dtype,idx,ids", PAGE_CASES)
def test_scatter_matches_indexing_and_leaves_other_pages(
    device, layers, pages, page, heads, dim, dtype, idx, ids
):
    kv = _pool(layers, pages, page, heads, dim, dtype, device)
    expected = kv.clone()
    page_ids = torch.tensor(ids, dtype=idx, device=device)
    buf = _pool(layers, len(ids), page, heads, dim, dtype, device, seed=1)
    scatter_kv_pages(buf, kv, page_ids)
    scatter_kv_pages_ref(buf, expected, page_ids)
    torch.testing.assert_close(kv, expected, atol=0, rtol=0)


def test_gather_then_scatter_moves_pages_between_pools(device):
    """The transfer path: gather pages on one pool, scatter into different pages of another."""
    src = _pool(2, 8, 16, 2, 64, BF16, device)
    dst = torch.full_like(src, float("nan"))
    buf = gather_kv_pages(src, torch.tensor([6, 1, 3], dtype=torch.int32, device=device))
    scatter_kv_pages(buf, dst, torch.tensor([0, 7, 2], dtype=torch.int32, device=device))
    for s, d in [(6, 0), (1, 7), (3, 2)]:
        torch.testing.assert_close(dst[:, :, d], src[:, :, s], atol=0, rtol=0)
    assert torch.isnan(dst[:, :, [1, 3, 4, 5, 6]]).all()


@pytest.mark.parametrize(
    "page,heads,dim,dtype,locs",
    [
        (16, 2, 64, F32, [3, 17, 40, 159, 0]),
        (1, 3, 32, BF16, [9, 2]),
        (64, 1, 64, BF16, [130, 64, 65, 1]),
        (16, 8, 64, F32, [5, -1, 6]),  # a negative slot is padding: skipped
    ],
)
def test_store_kv_matches_index_copy(device, page, heads, dim, dtype, locs):
    kv = _pool(1, 160 // page + 2, page, heads, dim, dtype, device)
    k_cache, v_cache = kv[0, 0], kv[0, 1]  # views, as pool.k(layer) / pool.v(layer)
    ek, ev, original = k_cache.clone(), v_cache.clone(), k_cache.clone()
    T = len(locs)
    # k, v as slices of a fused projection output: token stride wider than heads * dim
    kv_new = torch.randn(T, 3 * heads * dim).to(dtype).to(device)
    k = kv_new[:, : heads * dim].view(T, heads, dim)
    v = kv_new[:, heads * dim : 2 * heads * dim].view(T, heads, dim)
    loc = torch.tensor(locs, dtype=torch.int64, device=device)
    store_kv(k_cache, v_cache, k, v, loc)
    store_kv_ref(ek, ev, k, v, loc)
    torch.testing.assert_close(k_cache, ek, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ev, atol=0, rtol=0)
    assert not torch.equal(k_cache, original)  # the store did write something


def test_wrappers_reject_bad_arguments(device):
    kv = _pool(2, 4, 16, 2, 64, F32, device)
    with pytest.raises(TypeError, match="page_ids"):
        gather_kv_pages(kv, torch.tensor([1.0], device=device))
    with pytest.raises(ValueError, match="contiguous within a page"):
        gather_kv_pages(kv.transpose(3, 4), torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="buf"):
        scatter_kv_pages(kv[:, :, :2], kv, torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="heads"):
        store_kv(kv[0, 0], kv[0, 1], torch.randn(2, 3, 64), torch.randn(2, 3, 64), torch.tensor([0, 1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_scatter_large_gpu():
    kv = torch.randn((32, 2, 4096, 16, 8, 128), dtype=BF16, device="cuda")
    ids = torch.randperm(4096, device="cuda")[:1000].int()
    buf = gather_kv_pages(kv, ids)
    torch.testing.assert_close(buf, gather_kv_pages_ref(kv, ids), atol=0, rtol=0)
    fresh = torch.randn_like(buf)
    scatter_kv_pages(fresh, kv, ids)
    torch.testing.assert_close(kv[:, :, ids.long()], fresh, atol=0, rtol=0)
