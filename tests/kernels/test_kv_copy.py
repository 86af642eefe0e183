"""The new-token KV store against torch indexing."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_copy import store_kv, store_kv_ref

F32, BF16 = torch.float32, torch.bfloat16


def _pool(layers, pages, page, heads, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, pages, page, heads, dim), generator=g).to(dtype).to(device)


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

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    with pytest.raises(TypeError, match="out_cache_loc"):
        store_kv(kv[0, 0], kv[0, 1], rand(2, 2, 64), rand(2, 2, 64), torch.tensor([0.0, 1.0], device=device))
    with pytest.raises(ValueError, match="heads"):
        store_kv(kv[0, 0], kv[0, 1], rand(2, 3, 64), rand(2, 3, 64), torch.tensor([0, 1], device=device))
