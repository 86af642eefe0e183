"""KV cache copies: page gather/scatter for KV transfer, and the store of new tokens' K/V.

The page copies take a layer-major view `[L, 2, num_pages, page_size, H, D]` with any strides
(pdserve's page-major pool passes `pool.kv.permute(1, 2, 0, 3, 4, 5)`); a page of one layer's K
(or V) is one contiguous run of page_size * H * D elements, so gather and scatter are block copies
of those runs between the pool and a contiguous buffer `[L, 2, n, page_size, H, D]`. KV transfer
itself no longer uses them: with the page-major pool a page is one contiguous block, moved by
`index_select` / `index_copy_` or sent as it is (`kv_transfer/layout.py`).
`store_kv` writes new tokens into each layer's strided `[num_pages, page_size, H, D]` view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import (
    FLOAT_DTYPES,
    cdiv,
    check_launchable,
    check_shape,
    check_tensor,
    next_pow2,
)

_COPY_BLOCK = 4096  # elements per program: 8 KiB of bf16, enough in flight per SM
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _page_copy_kernel(
    Src,
    Dst,
    PageIds,  # [n]
    stride_src_l,
    stride_src_c,
    stride_src_p,
    stride_dst_l,
    stride_dst_c,
    stride_dst_p,
    PAGE_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
):
    i = tl.program_id(0)  # i-th page of the list
    lc = tl.program_id(1)  # layer * 2 + (0: K, 1: V)
    chunk = tl.program_id(2)
    # int64: layer * layer_stride overflows int32 on pools over 2^31 elements
    layer = (lc // 2).to(tl.int64)
    kind = (lc % 2).to(tl.int64)
    page = tl.load(PageIds + i).to(tl.int64)
    if GATHER:
        src_page = page
        dst_page = i.to(tl.int64)
    else:
        src_page = i.to(tl.int64)
        dst_page = page
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_ELEMS
    src = Src + layer * stride_src_l + kind * stride_src_c + src_page * stride_src_p
    dst = Dst + layer * stride_dst_l + kind * stride_dst_c + dst_page * stride_dst_p
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _check_pages_layout(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, 6, FLOAT_DTYPES)
    _, _, _, ps, H, D = t.shape
    if t.stride(5) != 1 or t.stride(4) != D or t.stride(3) != H * D:
        raise ValueError(f"{name} must be contiguous within a page ([page_size, H, D]), strides {t.stride()}")


def _launch_page_copy(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor, gather: bool) -> None:
    L, _, _, ps, H, D = src.shape
    n = page_ids.shape[0]
    if n == 0:
        return
    check_launchable(_page_copy_kernel, src.device)
    page_elems = ps * H * D
    block = min(_COPY_BLOCK, next_pow2(page_elems))
    _page_copy_kernel[(n, 2 * L, cdiv(page_elems, block))](
        src, dst, page_ids,
        src.stride(0), src.stride(1), src.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        PAGE_ELEMS=page_elems, BLOCK=block, GATHER=gather,
        num_warps=4,
    )  # fmt: skip


def gather_kv_pages(
    kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy pages `page_ids` [n] of every layer's K and V out of the pool `kv` [L, 2, P, ps, H, D].

    Returns the transfer buffer [L, 2, n, ps, H, D] (written into `out` when given).
    """
    _check_pages_layout("kv", kv)
    check_tensor("page_ids", page_ids, 1, _INDEX_DTYPES, kv.device)
    L, _, _, ps, H, D = kv.shape
    n = page_ids.shape[0]
    if out is None:
        out = torch.empty((L, 2, n, ps, H, D), dtype=kv.dtype, device=kv.device)
    else:
        _check_pages_layout("out", out)
        check_tensor("out", out, 6, (kv.dtype,), kv.device)
        check_shape("out", out, (L, 2, n, ps, H, D))
    _launch_page_copy(kv, out, page_ids, gather=True)
    return out


def scatter_kv_pages(buf: torch.Tensor, kv: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Copy the transfer buffer `buf` [L, 2, n, ps, H, D] into pages `page_ids` [n] of `kv`."""
    _check_pages_layout("kv", kv)
    _check_pages_layout("buf", buf)
    check_tensor("buf", buf, 6, (kv.dtype,), kv.device)
    check_tensor("page_ids", page_ids, 1, _INDEX_DTYPES, kv.device)
    L, _, _, ps, H, D = kv.shape
    check_shape("buf", buf, (L, 2, page_ids.shape[0], ps, H, D))
    _launch_page_copy(buf, kv, page_ids, gather=False)


def gather_kv_pages_ref(kv: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    return kv[:, :, page_ids.long()]  # [L, 2, n, ps, H, D]


def scatter_kv_pages_ref(buf: torch.Tensor, kv: torch.Tensor, page_ids: torch.Tensor) -> None:
    kv[:, :, page_ids.long()] = buf


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
