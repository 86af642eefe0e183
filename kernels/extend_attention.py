"""Extend (prefill) attention over paged KV: packed new tokens of many requests in one launch.

Each request's new tokens (rows qo_indptr[b]:qo_indptr[b+1] of q) attend causally to the request's
cached prefix plus the new tokens up to themselves. The new tokens' K/V must already be stored
in the pages (the backend stores them first), so keys come from one place: the page table.

One program covers BLOCK_M rows of one (request, kv head): the rows are (token, head) pairs of
the GQA group, token-major, so short extends (speculative verify with k+1 candidates) still fill
a tile: 4 candidates x 8 query heads = 32 rows, all sharing each K/V load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import (
    cdiv,
    check_launchable,
    check_paged_attention,
    check_tensor,
    interpreted,
    next_pow2,
    output_like,
)
from pdserve.kernels._online_softmax import attend_pages

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q,  # [T, Hq, D]
    K,  # [num_pages, page_size, Hkv, D]
    V,
    Out,  # [T, Hq, D]
    PageTable,  # [B, max_pages] int32
    SeqLens,  # [B] int32, prefix + new
    QoIndptr,  # [B + 1] int32
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    sm_scale_log2,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblock = tl.program_id(2)
    q_start = tl.load(QoIndptr + b)
    ext = tl.load(QoIndptr + b + 1) - q_start
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - ext

    rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP  # [BLOCK_M] index among this request's new tokens
    head = kvh * GROUP + rows % GROUP  # [BLOCK_M] query head
    mask_m = tok < ext
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + tok  # [BLOCK_M] absolute position of each row's token

    # Causal bound: keys past the block's last token are never visible. Blocks beyond the
    # request's rows run no iterations and store nothing.
    last_tok = tl.minimum((mblock * BLOCK_M + BLOCK_M - 1) // GROUP, ext - 1)
    kv_end = tl.where(mblock * BLOCK_M < ext * GROUP, prefix + last_tok + 1, 0)
    pt_row = PageTable + b.to(tl.int64) * stride_pt
    m_i, l_i, acc = attend_pages(
        q, q_pos, K, V, pt_row, 0, kv_end,
        stride_kp, stride_ks, kvh * stride_kh, stride_vp, stride_vs, kvh * stride_vh, sm_scale_log2,
        BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, True, DOT_PRECISION, UPCAST,
    )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_extend_len: int,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their requests' pages (new tokens' K/V stored).

    q [T, Hq, D] request-major; k_cache/v_cache [num_pages, page_size, Hkv, D]; page_table
    [B, max_pages] int32; qo_indptr [B + 1] int32; seq_lens [B] int32 (prefix + new);
    `max_extend_len` is a host-side upper bound of the new tokens per request (sizes the grid).
    Returns out [T, Hq, D].
    """
    page_size, Hkv = check_paged_attention(q, k_cache, v_cache, page_table, seq_lens)
    check_tensor("qo_indptr", qo_indptr, 1, (torch.int32,), q.device)
    T, Hq, D = q.shape
    B = seq_lens.shape[0]
    if qo_indptr.shape[0] != B + 1 or page_table.shape[0] != B:
        raise ValueError(
            f"qo_indptr {tuple(qo_indptr.shape)} must be [B + 1] and page_table {tuple(page_table.shape)} "
            f"[B, max_pages] for B = {B}"
        )
    out = output_like(q, out)
    if B == 0 or T == 0:
        return out
    check_launchable(_extend_kernel, q.device)
    group = Hq // Hkv
    rows = max(1, int(max_extend_len)) * group
    if block_m is None:
        block_m = min(64, max(16, next_pow2(rows)))
    _extend_kernel[(B, Hkv, cdiv(rows, block_m))](
        q, k_cache, v_cache, out, page_table, seq_lens, qo_indptr,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        scale * _LOG2E,
        HEAD_DIM=D, GROUP=group, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_extend_kernel),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference (fp32 math, one request at a time): same arguments, same result."""
    T, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    indptr = qo_indptr.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = indptr[b], indptr[b + 1]
        prefix = n - (hi - lo)
        pos = torch.arange(n, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size  # [n]
        k = k_cache.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        v = v_cache.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("thd,nhd->htn", q[lo:hi].float(), k) * scale  # [Hq, new, n]
        qpos = prefix + torch.arange(hi - lo, device=q.device)
        s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out
