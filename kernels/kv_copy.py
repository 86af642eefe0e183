"""The store of new tokens' K/V into the paged pool.

`store_kv` writes new tokens into each layer's strided `[num_pages, page_size, H, D]` view. (KV
transfer needs no kernel: with the page-major pool a page of every layer is one contiguous block,
moved by `index_select` / `index_copy_` or sent as it is; see `kv_transfer/layout.py`.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import (
    FLOAT_DTYPES,
    check_launchable,
    check_shape,
    check_tensor,
    next_pow2,
)

_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _store_kv_kernel(
    K,  # [T, H, D] new keys
    V,
    KCache,  # [num_pages, page_size, H, D]
    VCache,
    Loc,  # [T] slot = page * page_size + offset; negative: skip (padding)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    loc = tl.load(Loc + t).to(tl.int64)
    page = loc // PAGE_SIZE
    in_page = loc % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # loc broadcast to the tile first: a scalar bool in the mask trips the interpreter.
    slot = loc + tl.zeros([BLOCK_H, BLOCK_D], tl.int64)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = KCache + page * stride_kcp + in_page * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = VCache + page * stride_vcp + in_page * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Write new tokens' k/v [T, H, D] into k_cache/v_cache [num_pages, page_size, H, D].

    out_cache_loc [T] (int32 or int64) holds each token's slot page * page_size + offset; a
    negative slot is skipped (padded rows of a fixed-size batch).
    """
    check_tensor("k", k, 3, FLOAT_DTYPES)
    dev = k.device
    check_tensor("v", v, 3, (k.dtype,), dev)
    check_tensor("k_cache", k_cache, 4, (k.dtype,), dev)
    check_tensor("v_cache", v_cache, 4, (k.dtype,), dev)
    check_tensor("out_cache_loc", out_cache_loc, 1, _INDEX_DTYPES, dev)
    T, H, D = k.shape
    check_shape("v", v, (T, H, D))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if tuple(k_cache.shape[2:]) != (H, D):
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} != new k/v {(H, D)}")
    check_shape("out_cache_loc", out_cache_loc, (T,))
    if T == 0:
        return
    check_launchable(_store_kv_kernel, dev)
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, out_cache_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=H, HEAD_DIM=D, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D),
        num_warps=4,
    )  # fmt: skip


def store_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    keep = out_cache_loc >= 0
    loc = out_cache_loc[keep].long()
    H, D = k.shape[1:]
    k_cache.view(-1, H, D).index_copy_(0, loc, k[keep])
    v_cache.view(-1, H, D).index_copy_(0, loc, v[keep])
